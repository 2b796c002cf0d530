#!lua
-- idem claim: take KEYS[1] for one run of the body, or say why not.
-- Record format and reply codes: lua/README.md. Every argument is checked
-- before the first write because Redis does not roll a script back.
local key = KEYS[1]
local token, lease, ttl, fp = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if #KEYS ~= 1 or #ARGV ~= 4 then
  return redis.error_reply('ERR idem claim: expected 1 key and 4 arguments')
end
if #token ~= 32 or not string.find(token, '^%x+$') then
  return redis.error_reply('ERR idem claim: owner token must be 32 hex digits')
end
if not lease or lease < 1 or lease % 1 ~= 0 then
  return redis.error_reply('ERR idem claim: lease must be a positive whole number of ms')
end
if not ttl or ttl < lease or ttl % 1 ~= 0 then
  return redis.error_reply('ERR idem claim: ttl must be whole ms, at least the lease')
end
if #fp > 32 then
  return redis.error_reply('ERR idem claim: fingerprint longer than 32 bytes')
end

local rec = redis.pcall('GET', key)
if type(rec) == 'table' then
  -- WRONGTYPE: not a string, so not ours. Any other error (an ACL that does
  -- not grant GET) goes back as it is, not disguised as a wrong type.
  if not string.find(rec.err or '', 'WRONGTYPE', 1, true) then
    return rec
  end
  return {7}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function pending(f, attempt)
  return '1P' .. string.char(#f) .. f .. token .. string.format('%d:%d', now + lease, attempt)
end

if not rec then
  redis.call('SET', key, pending(fp, 1), 'PX', ttl)
  return {1, 1}
end

local fplen = string.byte(rec, 3)
if string.sub(rec, 1, 1) ~= '1' or not fplen or fplen > 32 or #rec < 3 + fplen then
  return {6, rec}
end
local stored_fp = string.sub(rec, 4, 3 + fplen)
local state = string.sub(rec, 2, 2)
-- An absent fingerprint on either side matches anything: only two known,
-- different payloads are a mismatch.
local mismatch = fp ~= '' and stored_fp ~= '' and fp ~= stored_fp

if state ~= 'P' then
  if not string.find('CZLU', state, 1, true) then
    return {6, rec}
  end
  if mismatch then
    return {5}
  end
  return {3, rec, redis.call('PTTL', key)}
end

local owner = string.sub(rec, 4 + fplen, 35 + fplen)
local deadline, attempt = string.match(rec, '^(%d+):(%d+)$', 36 + fplen)
if #owner ~= 32 or not deadline then
  return {6, rec}
end
if mismatch then
  return {5}
end
deadline, attempt = tonumber(deadline), tonumber(attempt)
if owner == token then
  -- Our own claim again: its reply was lost and the client re-sent it.
  redis.call('SET', key, pending(stored_fp, attempt), 'PX', ttl)
  return {1, attempt}
end
if deadline > now then
  return {4, deadline - now}
end
-- The holder stopped renewing: take over and count the attempt.
if fp == '' then
  fp = stored_fp
end
redis.call('SET', key, pending(fp, attempt + 1), 'PX', ttl)
return {1, attempt + 1}
