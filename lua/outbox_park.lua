-- idem outbox park: marks the stream entry ARGV[1] parked (the broker
-- refused it) with ARGV[2] = "attempts:parked-at-ms:reason", only while the
-- entry is still in the stream (an operator may have dropped it). The entry
-- stays where it is, so its key's later messages keep waiting behind it and
-- a retry sends it first.
local stream, parked, entry, why = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
if #redis.call('XRANGE', stream, entry, entry) == 0 then
  return 0
end
redis.call('HSET', parked, entry, why)
return 1
