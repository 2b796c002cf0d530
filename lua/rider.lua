-- idem rider (no flags): the commands a batch's finish carries after its
-- writes (RedisStore::finish_batch_then; a Redis Streams consumer's XACK),
-- run only once every result of the batch is stored. KEYS are the keys
-- of the batch's completes, ARGV the carried command and its arguments.
-- A key that does not hold a completed record (its complete was not
-- stored in this round trip: the script was gone, NOSCRIPT; SET … IFEQ
-- did not match or was refused; it is stored after, alone) withholds the
-- command, which then answers an UNSTORED error reply: its maker sends it
-- itself once the results are stored. So an entry is never acked before
-- its result is stored. Not allow-oom: out of memory (when a plain SET …
-- IFEQ is refused too) the command is withheld as well.
--
-- The keys are read by one MGET per chunk, as in complete_batch.lua.

local CHUNK = 1000
for first = 1, #KEYS, CHUNK do
  local last = math.min(first + CHUNK - 1, #KEYS)
  local held = redis.pcall('MGET', unpack(KEYS, first, last))
  if held.err then
    return held
  end
  for i = first, last do
    local rec = held[i - first + 1]
    local state = rec and header(rec)
    if not state or state == PENDING then
      return redis.error_reply('UNSTORED idem rider: ' .. KEYS[i] .. ' holds no stored '
        .. 'result yet; the carried command was not run')
    end
  end
end
if #ARGV == 0 then
  return redis.error_reply('ERR idem rider: expected the carried command after the keys')
end
local reply = redis.pcall(unpack(ARGV))
-- A refusal by the ACL answers NOPERM, as the command sent by itself
-- would (a script's refusal reads "ERR … can't run this command" on
-- Redis 7.0): its maker then stops carrying it.
if type(reply) == 'table' and reply.err and not redis.acl_check_cmd(unpack(ARGV)) then
  return redis.error_reply('NOPERM idem rider: this user may not run ' .. ARGV[1] .. ' ('
    .. reply.err .. ')')
end
return reply
