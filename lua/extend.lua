-- idem extend (flags: allow-oom): restart our lease (it now ends `lease` ms
-- from now, server time), only if we still own the record. allow-oom:
-- keeping a running body's lease must not fail because Redis is full.
local key, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if #KEYS ~= 1 or #ARGV ~= 2 or #token ~= 32 or not lease or lease < 1 or lease % 1 ~= 0 then
  return redis.error_reply('ERR idem extend: expected 1 key, a token (32 bytes) and lease ms >= 1')
end
local rec, n, _, attempt, steps = owned(key, token)
if not rec then
  return n
end
-- The lease ends when the key's remaining TTL falls to lease_end. Keep at
-- least one more lease of record after that, so an expired lease is still
-- seen (and counted) as a takeover rather than a fresh key.
local pttl = redis.call('PTTL', key)
if pttl < 2 * lease then
  pttl = 2 * lease
  redis.call('PEXPIRE', key, pttl)
end
redis.call('SET', key, string.sub(rec, 1, 35 + n)
  .. string.format('%d:%s', pttl - lease, attempt) .. steps, 'KEEPTTL')
return DONE
