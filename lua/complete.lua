-- idem complete (flags: allow-oom): replace our pending record by the
-- completed record ARGV[2], built by the client, only if we still own it.
--
-- The record is read and compared before anything is written, so a
-- complete that is refused writes nothing (no keyspace event, no broken
-- WATCH, no write past maxmemory). KEEPTTL: the result TTL counts from the
-- claim. allow-oom: the body has already run, and storing its result
-- matters more than the memory limit.
--
-- With outgoing messages (outbox::stage): KEYS[2] is the outbox stream (on
-- the record's slot) and ARGV[3..] are (id, topic, key, payload) per
-- message, appended to the stream in order in this same step. When any
-- message has headers, ARGV[3] is empty (no message id is) and (id, topic,
-- key, payload, headers) follow per message: a message's encoded headers
-- (idem-redis/src/store/outbox.rs) go in its entry's `headers` field, and
-- an empty one writes no field, so an entry without headers is the same
-- as before they existed. Everything that could refuse the appends is
-- checked before anything is written, so the result and its messages are
-- stored together or not at all.
local key, token, rec, stream = KEYS[1], ARGV[1], ARGV[2], KEYS[2]
local kind, n = header(rec)
local fields = #ARGV - 2
local first, width = 3, 4
if fields > 0 and ARGV[3] == '' then
  first, width, fields = 4, 5, fields - 1
end
if not kind or kind == PENDING or #token ~= 32 or #KEYS < 1 or #KEYS > 2
    or (stream == nil) ~= (fields == 0) or fields % width ~= 0 then
  return redis.error_reply('ERR idem complete: expected 1 key, a 32-byte token and a completed '
    .. 'record ("1", kind C/Z/L/U, fingerprint length, fingerprint, value), and with an outbox '
    .. 'stream as a second key, (id, topic, key, payload) per message, or an empty argument '
    .. 'then (id, topic, key, payload, headers) per message')
end

local reply, waited
reply, rec, waited = completing(key, token, rec, kind, n)
if reply then
  return reply
end
if stream then
  if not redis.acl_check_cmd('XADD', stream, '*', 'id', '')
      or not redis.acl_check_cmd('TYPE', stream) then
    return redis.error_reply('NOPERM idem complete: this user may not XADD to the outbox '
      .. 'stream ' .. stream .. '; grant it +xadd +type on the outbox keys (docs/operating.md)')
  end
  local t = redis.call('TYPE', stream)['ok']
  if t ~= 'stream' and t ~= 'none' then
    return redis.error_reply('ERR idem complete: the outbox key ' .. stream .. ' holds a ' .. t
      .. ', not a stream: delete it or give the store another outbox prefix')
  end
end
redis.call('SET', key, rec, 'KEEPTTL')
for i = first, #ARGV, width do
  local headers = width == 5 and ARGV[i + 4] or ''
  if headers == '' then
    redis.call('XADD', stream, '*', 'id', ARGV[i], 'topic', ARGV[i + 1], 'key', ARGV[i + 2],
      'payload', ARGV[i + 3])
  else
    redis.call('XADD', stream, '*', 'id', ARGV[i], 'topic', ARGV[i + 1], 'key', ARGV[i + 2],
      'payload', ARGV[i + 3], 'headers', headers)
  end
end
-- Only a record a waiter marked (its claim, made once it was subscribed,
-- wrote WAITED) has anyone to wake: an unmarked one publishes nothing.
if waited then
  notify(key, 'completed')
end
return DONE
