#!lua flags=allow-oom
-- idem complete: replace our pending record by the completed record
-- ARGV[2], built by the client, only if we still own it. Codes: lua/README.md.
--
-- The record is read and compared before anything is written, so a
-- complete that is refused writes nothing (no keyspace event, no broken
-- WATCH, no write past maxmemory). KEEPTTL: the result TTL counts from the
-- claim. allow-oom: the body has already run, and storing its result
-- matters more than the memory limit.
local key, token, rec = KEYS[1], ARGV[1], ARGV[2]
local v, k, n = string.byte(rec, 1, 3)
if v ~= 49 or not n or n > 32 or #rec < 3 + n or (k ~= 67 and k ~= 90 and k ~= 76 and k ~= 85)
    or #token ~= 32 or #KEYS ~= 1 or #ARGV ~= 2 then
  return redis.error_reply('ERR idem complete: expected 1 key, a 32-byte token and a completed '
    .. 'record ("1", kind C/Z/L/U, fingerprint length, fingerprint, value)')
end

local old = redis.pcall('GET', key)
if type(old) == 'table' then
  if string.find(old.err or '', 'WRONGTYPE', 1, true) then
    return 7
  end
  return old
end
if not old then
  return 0
end

local ov, os, on = string.byte(old, 1, 3)
if ov ~= 49 or not on or on > 32 or #old < 3 + on then
  return 6
end
if os ~= 80 then
  if os ~= 67 and os ~= 90 and os ~= 76 and os ~= 85 then
    return 6
  end
  -- Completed already. Holding exactly this result, it is this same
  -- complete sent again (a reply lost, the connection re-sent it): done.
  -- A different result means another holder took over and stored its own.
  if os == k and string.sub(old, 4 + on) == string.sub(rec, 4 + n) then
    return 1
  end
  return 3
end
if string.sub(old, 4 + on, 35 + on) ~= token then
  return 2
end
-- Ours. The completed record keeps the claim's fingerprint.
if on ~= n or (n > 0 and string.sub(old, 4, 3 + on) ~= string.sub(rec, 4, 3 + n)) then
  rec = '1' .. string.char(k, on) .. string.sub(old, 4, 3 + on) .. string.sub(rec, 4 + n)
end
redis.call('SET', key, rec, 'KEEPTTL')
return 1
