-- idem outbox prune (cluster): forgets the stream ARGV[1] in the index
-- KEYS[1] only while its score is still ARGV[2], the one the relay read
-- when it found the stream empty. A complete names its stream in the index
-- (a newer score) before it appends, so a stream that is being written to
-- again is never forgotten.
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
