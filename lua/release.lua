#!lua flags=allow-oom
-- idem release: delete our pending record so the next call runs the body,
-- only if we still own it (compare-and-delete). allow-oom: a full Redis must
-- still be able to free keys. Codes: lua/README.md.
local key, token = KEYS[1], ARGV[1]
if #KEYS ~= 1 or #ARGV ~= 1 or #token ~= 32 then
  return redis.error_reply('ERR idem release: expected 1 key and a token (32 bytes)')
end
local rec = redis.pcall('GET', key)
if type(rec) == 'table' then
  if string.find(rec.err or '', 'WRONGTYPE', 1, true) then
    return 7
  end
  return rec
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
redis.call('DEL', key)
return 1
