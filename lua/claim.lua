-- idem claim (the contended path): take KEYS[1] for one run of the body,
-- or say why not. The client sends a plain SET NX GET first and runs this
-- only when that found a pending record; it starts with the same SET NX GET,
-- so a record that vanished in between is simply claimed.
--
-- ARGV[1] is the pending record to write, built by the client ("1P", FPLEN,
-- FP, TOKEN, LEASE_END, ":1"), ARGV[2] the TTL in ms, ARGV[3] "1" when a
-- completed record's remaining TTL is wanted, ARGV[4] (optional) "1" when the caller
-- is subscribed to the key's channel and will wait (see below). Leases are measured against
-- the key's own expiry (server time): LEASE_END is the PTTL at which the
-- lease runs out, so no TIME call is needed.
local key, mine = KEYS[1], ARGV[1]
-- The whole record is checked before the first write (Redis does not roll
-- a script back on error), so a record that every later claim would refuse
-- as corrupt is never written: TOKEN 32 hex digits, LEASE_END digits from 1
-- to below the TTL (the record must outlive the lease, or a dead holder's
-- key would look fresh), ATTEMPT 1.
local state, n = header(mine)
local lease_end = state == PENDING
  and string.match(mine, '^%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x(%d+):1$', 4 + n)
if not lease_end or #lease_end > 15 or tonumber(lease_end) < 1
    or tonumber(lease_end) >= (tonumber(ARGV[2]) or 0) or #KEYS ~= 1 or #ARGV < 3 or #ARGV > 4 then
  return redis.error_reply('ERR idem claim: expected 1 key, a pending record ("1P", '
    .. 'fingerprint length, fingerprint, 32 hex digit token, lease end below the ttl, ":1"), ttl ms, want_ttl, '
    .. 'optionally waiting')
end

-- A malformed TTL makes SET fail before it writes anything.
local rec = redis.pcall('SET', key, mine, 'NX', 'PX', ARGV[2], 'GET')
if not rec then
  return {DONE, 1}
end
if type(rec) == 'table' then
  local code = failed(rec)
  if code == WRONG_TYPE then
    return {WRONG_TYPE}
  end
  return code
end

local found, fplen = header(rec)
if not found then
  return {UNREADABLE, rec}
end
local stored_fp = string.sub(rec, 4, 3 + fplen)
local fp = string.sub(mine, 4, 3 + n)
-- An absent fingerprint on either side matches anything: only two known,
-- different payloads are a mismatch.
local mismatch = fp ~= '' and stored_fp ~= '' and fp ~= stored_fp

if found ~= PENDING then
  if mismatch then
    return {MISMATCH}
  end
  if ARGV[3] == '1' then
    return {COMPLETED, rec, redis.call('PTTL', key)}
  end
  return {COMPLETED, rec}
end

local owner, held_end, attempt, steps, waited = pending(rec, fplen)
if not owner then
  return {UNREADABLE, rec}
end
if mismatch then
  return {MISMATCH}
end
-- Capped where the client's u32 saturates, so both stores agree.
attempt = math.min(tonumber(attempt), 4294967295)
local token = string.sub(mine, 4 + n, 35 + n)
if owner ~= token then
  local left = redis.call('PTTL', key) - tonumber(held_end)
  if left > 0 then
    -- A caller that will wait for the holder, subscribed to the key's
    -- channel before this claim, marks the record (once), so that the
    -- holder's complete publishes: complete wakes only marked records,
    -- and a holder's SET IFEQ of the bytes it wrote no longer matches.
    -- The TTL and every other field stay as they are.
    if ARGV[4] == '1' and not waited then
      redis.call('SET', key, rec .. WAITED, 'KEEPTTL')
    end
    return {IN_PROGRESS, left}
  end
  -- The holder stopped renewing: take over and count the attempt. The
  -- taker's fingerprint, when it gives one, describes the run to come.
  attempt = math.min(attempt + 1, 4294967295)
  if fp == '' then
    fp = stored_fp
  end
else
  -- Our own claim again (its reply was lost and it was re-sent): the same
  -- claim, so the same fingerprint.
  fp = stored_fp
end
-- Either way the lease starts now: our record, with this attempt number,
-- and the steps earlier holders finished (run_steps), kept as they are.
-- '%d': a Lua number past 1e14 would print as "1e+14".
redis.call('SET', key, '1P' .. string.char(#fp) .. fp .. token
  .. string.format('%s:%d', lease_end, attempt) .. steps, 'PX', ARGV[2])
return {DONE, attempt}
