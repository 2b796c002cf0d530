-- idem suspend (flags: allow-oom): end our lease at once but keep the
-- finished steps (a run_steps body failed), only if we still own the
-- record: the next claim takes it over (attempt + 1) and resumes after the
-- steps. A record without steps is deleted, as release does.
local key, token = KEYS[1], ARGV[1]
if #KEYS ~= 1 or #ARGV ~= 1 or #token ~= 32 then
  return redis.error_reply('ERR idem suspend: expected 1 key and a token (32 bytes)')
end
local rec, n, _, attempt, steps = owned(key, token)
if not rec then
  return n
end
-- The waiter mark alone is no step: nothing to keep.
if steps == '' or steps == WAITED then
  redis.call('DEL', key)
else
  -- The lease is live while PTTL > LEASE_END: LEASE_END = PTTL ends it now.
  local pttl = math.max(redis.call('PTTL', key), 1)
  redis.call('SET', key, string.sub(rec, 1, 35 + n)
    .. string.format('%d:%s', pttl, attempt) .. steps, 'KEEPTTL')
end
notify(key, 'released')
return DONE
