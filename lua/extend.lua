#!lua flags=allow-oom
-- idem extend: push our lease deadline to now + lease (server time), only if
-- we still own the record. allow-oom: keeping a running body's lease must not
-- fail because Redis is full. Codes: lua/README.md.
local key, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if #KEYS ~= 1 or #ARGV ~= 2 then
  return redis.error_reply('ERR idem extend: expected 1 key and 2 arguments')
end
if #token ~= 32 or not string.find(token, '^%x+$') then
  return redis.error_reply('ERR idem extend: owner token must be 32 hex digits')
end
if not lease or lease < 1 or lease % 1 ~= 0 then
  return redis.error_reply('ERR idem extend: lease must be a positive whole number of ms')
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
local attempt = string.match(rec, ':(%d+)$', 36 + fplen)
if not attempt then
  return 6
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', key, string.sub(rec, 1, 35 + fplen) .. string.format('%d:%s', now + lease, attempt), 'KEEPTTL')
if redis.call('PTTL', key) < lease then
  redis.call('PEXPIRE', key, lease)
end
return 1
