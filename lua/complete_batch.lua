-- idem complete_batch (flags: allow-oom): a batch's completes in one call,
-- where the server has no SET … IFEQ (Redis 7): for each KEYS[i],
-- ARGV[3i - 2] the owner token, ARGV[3i - 1] the completed record and
-- ARGV[3i] the pending record the claim wrote, as the client rebuilds it.
-- A key that still holds exactly that record is ours and unmarked: the
-- completed record (built with its fingerprint) replaces it at once, as
-- SET … IFEQ would. Any other goes through the complete script's step
-- (without outbox messages: those complete alone). One script call
-- rather than one per key. Replies one code per key, or an error reply
-- for a malformed item; an item refused does not stop the others.
if #ARGV ~= 3 * #KEYS then
  return redis.error_reply('ERR idem complete_batch: expected an owner token, a completed '
    .. 'record and the pending record per key')
end
local out = {}
for i = 1, #KEYS do
  local key, token, rec, claimed = KEYS[i], ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local kind, n = header(rec)
  if not kind or kind == PENDING or #token ~= 32 then
    out[i] = redis.error_reply('ERR idem complete: expected a 32-byte token and a completed '
      .. 'record ("1", kind C/Z/L/U, fingerprint length, fingerprint, value)')
  elseif redis.pcall('GET', key) == claimed then
    redis.call('SET', key, rec, 'KEEPTTL')
    out[i] = DONE
  else
    local reply, done, waited = completing(key, token, rec, kind, n)
    if reply then
      out[i] = reply
    else
      redis.call('SET', key, done, 'KEEPTTL')
      -- Only a record a waiter marked has anyone to wake.
      if waited then
        notify(key, 'completed')
      end
      out[i] = DONE
    end
  end
end
return out
