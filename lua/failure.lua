-- idem count_failure: add one to the failure counter at KEYS[1] (a key of
-- its own beside the record, `namespace::failures:scope:key`, never a
-- record) and set it to expire in ARGV[1] ms. Returns {DONE, count}.
--
-- GET and SET rather than INCR, so a service's ACL needs no new command.
-- The count saturates at 2^32 - 1 (Rust reads it as a u32). A counter that
-- is not a decimal count (another program's key) is never overwritten.
local key, ttl = KEYS[1], ARGV[1]
if #KEYS ~= 1 or #ARGV ~= 1 or not string.match(ttl, '^%d+$') or #ttl > 14 then
  return redis.error_reply('ERR idem count_failure: expected 1 key and a ttl in ms')
end
local found = redis.pcall('GET', key)
if type(found) == 'table' then
  return failed(found)
end
local count = 0
if found then
  if #found > 10 or not string.match(found, '^%d+$') then
    return {UNREADABLE, found}
  end
  count = tonumber(found)
end
count = math.min(count + 1, 4294967295)
redis.call('SET', key, string.format('%d', count), 'PX', ttl)
return {DONE, count}
