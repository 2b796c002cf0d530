-- idem forget (flags: allow-oom): delete the record at KEYS[1] for an
-- operator, and hand back what it was. ARGV[1] = force ('1' or '0').
--
-- Checked and deleted in one step, so a holder that claims or renews
-- between an operator's look and the delete is never deleted by mistake:
-- a pending record whose lease is live is refused unless forced. Bytes
-- that are not an idem record (another program's key) are never deleted.
-- allow-oom: deleting frees memory.
local key, force = KEYS[1], ARGV[1]
if #KEYS ~= 1 or #ARGV ~= 1 or (force ~= '0' and force ~= '1') then
  return redis.error_reply('ERR idem forget: expected 1 key and force (0 or 1)')
end
local rec = redis.pcall('GET', key)
if type(rec) == 'table' then
  return failed(rec)
end
if not rec then
  return MISSING
end
local state, n = header(rec)
if not state then
  return {UNREADABLE, rec}
end
local pttl = redis.call('PTTL', key)
if state == PENDING then
  local owner, lease_end = pending(rec, n)
  if not owner then
    return {UNREADABLE, rec}
  end
  local left = pttl - tonumber(lease_end)
  if left > 0 and force ~= '1' then
    return {IN_PROGRESS, left, rec, pttl}
  end
end
redis.call('DEL', key)
notify(key, 'forgotten')
return {DONE, rec, pttl}
