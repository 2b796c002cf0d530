-- idem release (flags: allow-oom): delete our pending record so the next
-- call runs the body, only if we still own it (compare-and-delete).
-- allow-oom: a full Redis must still be able to free keys.
local key, token = KEYS[1], ARGV[1]
if #KEYS ~= 1 or #ARGV ~= 1 or #token ~= 32 then
  return redis.error_reply('ERR idem release: expected 1 key and a token (32 bytes)')
end
local rec, why = owned(key, token)
if not rec then
  return why
end
redis.call('DEL', key)
notify(key, 'released')
return DONE
