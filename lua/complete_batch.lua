-- idem complete_batch (flags: allow-oom): a batch's completes in one call,
-- where the server has no SET … IFEQ (Redis 7): for each KEYS[i],
-- ARGV[2i - 1] the completed record and ARGV[2i] the pending record the
-- claim wrote, as the client rebuilds it (the owner token is read from
-- it). A key that still holds exactly that record is ours and unmarked:
-- the completed record (built with its fingerprint) replaces it at once,
-- as SET … IFEQ would. Any other goes through the complete script's step
-- (without outbox messages: those complete alone). One script call
-- rather than one per key; a single call's complete told its claim runs
-- it too, for one key: its common path makes none of the record
-- operations (record_ops.lua), which the complete script makes first.
-- Replies one code per key, or an error reply for a malformed item; an
-- item refused does not stop the others.
--
-- The keys are read by one MGET per chunk, not one GET each: every
-- redis.call pays for building a command and turning its reply into Lua
-- values (lua/README.md has the counts). Chunks keep MGET's
-- arguments within what unpack can put on Lua's stack. A user whose ACL
-- predates MGET (docs/operating.md grants it now) is refused it: each key
-- is then read with GET, as before. So is a key MGET found empty or of
-- another type: its GET answers the same, the compare fails, and the
-- complete step gives its MISSING or WRONG_TYPE.

if #ARGV ~= 2 * #KEYS then
  return redis.error_reply('ERR idem complete_batch: expected a completed record and the '
    .. 'pending record per key')
end
local CHUNK = 1000
local out = {}
-- The complete step and the wake-up, made (record_ops) for the first key
-- that is not as its claim left it: most calls need neither.
local completing, notify
for first = 1, #KEYS, CHUNK do
  local last = math.min(first + CHUNK - 1, #KEYS)
  local held = redis.pcall('MGET', unpack(KEYS, first, last))
  if held.err then
    held = nil
  end
  for i = first, last do
    local key, rec, claimed = KEYS[i], ARGV[2 * i - 1], ARGV[2 * i]
    local kind, n = header(rec)
    if not kind or kind == PENDING then
      out[i] = redis.error_reply('ERR idem complete: expected a completed record ("1", kind '
        .. 'C/Z/L/U, fingerprint length, fingerprint, value)')
    elseif (held and held[i - first + 1] or redis.pcall('GET', key)) == claimed then
      redis.call('SET', key, rec, 'KEEPTTL')
      out[i] = DONE
    else
      local state, cn = header(claimed)
      local token = state == PENDING and string.sub(claimed, 4 + cn, 35 + cn)
      if not token or #token ~= 32 then
        out[i] = redis.error_reply('ERR idem complete_batch: expected the pending record the '
          .. 'claim wrote ("1", "P", fingerprint length, fingerprint, 32-byte token, ...)')
      else
        if not completing then
          completing, notify = record_ops()
        end
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
  end
end
return out
