-- idem step (flags: allow-oom): record one finished step of a run_steps
-- call in our pending record, only if we still own it: ARGV[2] is the
-- step's name, ARGV[3] its value (serde_json bytes). The step is appended
-- to the record (KEEPTTL: the result TTL still counts from the claim), so
-- a takeover's claim, which keeps the tail, hands it on; a complete
-- replaces the whole record. allow-oom: the step's effect has happened,
-- and recording it matters more than the memory limit.
local key, token, name, value = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
if #KEYS ~= 1 or #ARGV ~= 3 or #token ~= 32 or #name < 1 or #name > 128 then
  return redis.error_reply('ERR idem step: expected 1 key, a token (32 bytes), a step name '
    .. '(1 to 128 bytes) and its value')
end
local rec, n, _, _, steps = owned(key, token)
if not rec then
  return n
end
-- Recorded already: this same write re-sent after its reply was lost.
local _, found = steps_find(rec, #rec - #steps + 1, name)
if found then
  return DONE
end
redis.call('SET', key, rec .. '|' .. #name .. ':' .. name .. #value .. ':' .. value, 'KEEPTTL')
return DONE
