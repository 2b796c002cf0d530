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
local v, k, n = string.byte(rec, 1, 3)
if v ~= 49 or not n or n > 32 or #rec < 3 + n or (k ~= 67 and k ~= 90 and k ~= 76 and k ~= 85)
    or #token ~= 32 or #KEYS ~= 1 or #ARGV ~= 2 then
  return redis.error_reply('ERR idem complete: expected 1 key, a 32-byte token and a completed '
    .. 'record ("1", kind C/Z/L/U, fingerprint length, fingerprint, value)')
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

local ov, os, on = string.byte(old, 1, 3)
if os == 80 and ov == 49 and on and on <= 32 and string.sub(old, 4 + on, 35 + on) == token then
  -- Ours. The completed record keeps the claim's fingerprint.
  if on ~= n or (n > 0 and string.sub(old, 4, 3 + on) ~= string.sub(rec, 4, 3 + n)) then
    redis.call('SET', key, '1' .. string.char(k, on) .. string.sub(old, 4, 3 + on)
      .. string.sub(rec, 4 + n), 'KEEPTTL')
  end
  return 1
end
-- Not ours: undo.
redis.call('SET', key, old, 'KEEPTTL')
if ov ~= 49 or not on or on > 32 then
  return 6
end
if os ~= 80 then
  return 3
end
return 2
