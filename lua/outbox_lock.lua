-- idem outbox lock: takes or keeps the lock of one outbox stream for the
-- relay ARGV[1], for ARGV[2] ms. One relay drains a stream at a time, so a
-- key's messages go out in order; the others wait for the lock. Answers 1
-- when the caller holds it now, 0 when another relay does.
local lock, holder, ms = KEYS[1], ARGV[1], ARGV[2]
local now = redis.call('GET', lock)
if now and now ~= holder then
  return 0
end
redis.call('SET', lock, holder, 'PX', ms)
return 1
