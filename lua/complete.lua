-- idem complete (flags: allow-oom): replace our pending record by the
-- completed record ARGV[2], built by the client, only if we still own it.
--
-- The record is read and compared before anything is written, so a
-- complete that is refused writes nothing (no keyspace event, no broken
-- WATCH, no write past maxmemory). KEEPTTL: the result TTL counts from the
-- claim. allow-oom: the body has already run, and storing its result
-- matters more than the memory limit.
local key, token, rec = KEYS[1], ARGV[1], ARGV[2]
local kind, n = header(rec)
if not kind or kind == PENDING or #token ~= 32 or #KEYS ~= 1 or #ARGV ~= 2 then
  return redis.error_reply('ERR idem complete: expected 1 key, a 32-byte token and a completed '
    .. 'record ("1", kind C/Z/L/U, fingerprint length, fingerprint, value)')
end

local old, on, done, dn = owned(key, token)
if not old then
  -- Completed already. Holding exactly this result, it is this same
  -- complete sent again (a reply lost, the connection re-sent it): done.
  -- A different result means another holder took over and stored its own.
  if on == COMPLETED and string.sub(done, 2, 2) == kind
      and string.sub(done, 4 + dn) == string.sub(rec, 4 + n) then
    return DONE
  end
  return on
end
-- Ours. The completed record keeps the claim's fingerprint.
if on ~= n or (n > 0 and string.sub(old, 4, 3 + on) ~= string.sub(rec, 4, 3 + n)) then
  rec = '1' .. kind .. string.char(on) .. string.sub(old, 4, 3 + on) .. string.sub(rec, 4 + n)
end
redis.call('SET', key, rec, 'KEEPTTL')
notify(key, 'completed')
return DONE
