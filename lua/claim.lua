#!lua
-- idem claim: take KEYS[1] for one run of the body, or say why not.
-- Record format and reply codes: lua/README.md.
--
-- The common cases cost one command: a fresh key is created and a completed
-- record is read by the same SET NX GET. Leases are measured against the
-- key's own expiry (PTTL, server time): a pending record stores the PTTL at
-- which its lease runs out, so no TIME call is needed.
local key = KEYS[1]
local token, lease, ttl, fp = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
-- Every argument is checked before the first write: Redis does not roll a
-- script back on error.
if #KEYS ~= 1 or #ARGV ~= 5 or #token ~= 32 or not lease or not ttl or lease < 1
    or ttl < lease or lease % 1 ~= 0 or ttl % 1 ~= 0 or #fp > 32 then
  return redis.error_reply('ERR idem claim: expected 1 key and token (32 bytes), '
    .. 'lease ms >= 1, ttl ms >= lease, fingerprint (<= 32 bytes), want_ttl')
end

local rec = redis.pcall('SET', key, '1P' .. string.char(#fp) .. fp .. token
  .. string.format('%d:1', ttl - lease), 'NX', 'PX', ttl, 'GET')
if not rec then
  return 1
end
if type(rec) == 'table' then
  -- WRONGTYPE: not a string, so not ours. Any other error (an ACL that does
  -- not grant SET) goes back as it is.
  if string.find(rec.err or '', 'WRONGTYPE', 1, true) then
    return {7}
  end
  return rec
end

local fplen = string.byte(rec, 3)
if string.sub(rec, 1, 1) ~= '1' or not fplen or fplen > 32 or #rec < 3 + fplen then
  return {6, rec}
end
local stored_fp = string.sub(rec, 4, 3 + fplen)
-- An absent fingerprint on either side matches anything: only two known,
-- different payloads are a mismatch.
local mismatch = fp ~= '' and stored_fp ~= '' and fp ~= stored_fp
local state = string.sub(rec, 2, 2)

if state ~= 'P' then
  if not string.find('CZLU', state, 1, true) then
    return {6, rec}
  end
  if mismatch then
    return {5}
  end
  if ARGV[5] == '1' then
    return {3, rec, redis.call('PTTL', key)}
  end
  return {3, rec}
end

local owner = string.sub(rec, 4 + fplen, 35 + fplen)
local lease_end, attempt = string.match(rec, '^(%d+):(%d+)$', 36 + fplen)
if #owner ~= 32 or not lease_end then
  return {6, rec}
end
if mismatch then
  return {5}
end
attempt = tonumber(attempt)
if owner ~= token then
  local left = redis.call('PTTL', key) - tonumber(lease_end)
  if left > 0 then
    return {4, left}
  end
  -- The holder stopped renewing: take over and count the attempt. The
  -- taker's fingerprint, when it gives one, describes the run to come.
  attempt = attempt + 1
  if fp == '' then
    fp = stored_fp
  end
else
  -- Our own claim again (its reply was lost and it was re-sent): the same
  -- claim, so the same fingerprint.
  fp = stored_fp
end
-- Either way the lease starts now.
redis.call('SET', key, '1P' .. string.char(#fp) .. fp .. token
  .. string.format('%d:%d', ttl - lease, attempt), 'PX', ttl)
return {1, attempt}
