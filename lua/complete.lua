#!lua flags=allow-oom
-- idem complete: replace our pending record by the completed one, only if we
-- still own it (compare-and-set on the owner token). Codes: lua/README.md.
-- allow-oom: the body has already run; refusing its result because Redis is
-- full would make the next caller run it again after the lease.
local key = KEYS[1]
local token, ttl, kind, value = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
if #KEYS ~= 1 or #ARGV ~= 4 then
  return redis.error_reply('ERR idem complete: expected 1 key and 4 arguments')
end
if #token ~= 32 or not string.find(token, '^%x+$') then
  return redis.error_reply('ERR idem complete: owner token must be 32 hex digits')
end
if not ttl or ttl < 1 or ttl % 1 ~= 0 then
  return redis.error_reply('ERR idem complete: ttl must be a positive whole number of ms')
end
if #kind ~= 1 or not string.find('CZLU', kind, 1, true) then
  return redis.error_reply('ERR idem complete: kind must be one of C, Z, L, U')
end

local rec = redis.pcall('GET', key)
if type(rec) == 'table' then
  -- WRONGTYPE: not a string, so not ours. Any other error (an ACL that does
  -- not grant GET) goes back as it is, not disguised as a wrong type.
  if not string.find(rec.err or '', 'WRONGTYPE', 1, true) then
    return rec
  end
  return 7
end
if not rec then
  return 0
end
local fplen = string.byte(rec, 3)
if string.sub(rec, 1, 1) ~= '1' or not fplen or fplen > 32 then
  return 6
end
if string.sub(rec, 2, 2) ~= 'P' then
  return 3
end
if string.sub(rec, 4 + fplen, 35 + fplen) ~= token then
  return 2
end
redis.call('SET', key, '1' .. kind .. string.sub(rec, 3, 3 + fplen) .. value, 'PX', ttl)
return 1
