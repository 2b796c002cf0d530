-- idem outbox unlock: a relay stopping frees its stream's lock at once, so
-- another relay takes the stream over without waiting for the lease.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
