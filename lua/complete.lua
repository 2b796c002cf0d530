#!lua flags=allow-oom
-- idem complete: replace our pending record by the completed record
-- ARGV[2], built by the client, only if we still own it. Codes: lua/README.md.
--
-- One command in the common case: SET XX KEEPTTL GET writes the record and
-- hands back the one it replaced; if that was not ours, it is put back
-- exactly as it was, inside this same atomic script. KEEPTTL: the result
-- TTL counts from the claim. allow-oom: the body has already run, and
-- storing its result matters more than the memory limit.
local key, token, rec = KEYS[1], ARGV[1], ARGV[2]
if #KEYS ~= 1 or #ARGV ~= 2 or #token ~= 32 or #rec < 3 or string.sub(rec, 1, 1) ~= '1'
    or not string.find('CZLU', string.sub(rec, 2, 2), 1, true)
    or #rec < 3 + string.byte(rec, 3) then
  return redis.error_reply('ERR idem complete: expected 1 key, token (32 bytes) '
    .. 'and a completed record (1, kind C/Z/L/U, fingerprint length, fingerprint, value)')
end

local old = redis.pcall('SET', key, rec, 'XX', 'KEEPTTL', 'GET')
if not old then
  return 0
end
if type(old) == 'table' then
  if string.find(old.err or '', 'WRONGTYPE', 1, true) then
    return 7
  end
  return old
end

local fplen = string.byte(old, 3)
if string.sub(old, 1, 2) == '1P' and fplen and fplen <= 32
    and string.sub(old, 4 + fplen, 35 + fplen) == token then
  -- Ours. The completed record keeps the claim's fingerprint.
  local fp = string.sub(old, 3, 3 + fplen)
  if string.sub(rec, 3, 3 + string.byte(rec, 3)) ~= fp then
    redis.call('SET', key, '1' .. string.sub(rec, 2, 2) .. fp
      .. string.sub(rec, 4 + string.byte(rec, 3)), 'KEEPTTL')
  end
  return 1
end
-- Not ours: undo.
redis.call('SET', key, old, 'KEEPTTL')
if string.sub(old, 1, 1) ~= '1' or not fplen or fplen > 32 then
  return 6
end
if string.sub(old, 2, 2) ~= 'P' then
  return 3
end
return 2
