-- idem complete_batch (flags: allow-oom): a batch's completes in one call,
-- where the server has no SET … IFEQ (Redis 7): for each KEYS[i],
-- ARGV[2i - 1] the owner token and ARGV[2i] the completed record, exactly
-- the complete script's step without outbox messages (those complete
-- alone). One script call rather than one per key: on Redis 7 a call's
-- own cost is most of a complete's. Replies one code per key, or an error
-- reply for a malformed item; an item refused does not stop the others.
if #ARGV ~= 2 * #KEYS then
  return redis.error_reply('ERR idem complete_batch: expected an owner token and a completed '
    .. 'record per key')
end
local out = {}
for i = 1, #KEYS do
  local key, token, rec = KEYS[i], ARGV[2 * i - 1], ARGV[2 * i]
  local kind, n = header(rec)
  if not kind or kind == PENDING or #token ~= 32 then
    out[i] = redis.error_reply('ERR idem complete: expected a 32-byte token and a completed '
      .. 'record ("1", kind C/Z/L/U, fingerprint length, fingerprint, value)')
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
