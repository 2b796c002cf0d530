#!lua
-- idem claim: take KEYS[1] for one run of the body, or say why not.
-- Record format and reply codes: lua/README.md.
--
-- ARGV[1] is the pending record to write, built by the client ("1P", FPLEN,
-- FP, TOKEN, LEASE_END, ":1"), ARGV[2] the TTL in ms, ARGV[3] "1" when a
-- completed record's remaining TTL is wanted.
--
-- The common cases cost one command, like the floor: SET NX GET creates a
-- fresh record or returns the existing one in the same step. Leases are
-- measured against the key's own expiry (server time): LEASE_END is the
-- PTTL at which the lease runs out, so no TIME call is needed.
local key, mine = KEYS[1], ARGV[1]
-- Arguments are checked before the first write (Redis does not roll a
-- script back on error); multi-value string.byte keeps this cheap.
local v, s, n = string.byte(mine, 1, 3)
-- The whole record is checked, not just its ends: TOKEN (32 hex digits),
-- LEASE_END (digits, from 1 to below the TTL: the record must outlive the
-- lease, or a dead holder's key would look fresh) and ATTEMPT 1, so a malformed record is
-- never written to be refused as "corrupt" by every later claim.
local lease_end = v == 49 and s == 80 and n and n <= 32
  and string.match(mine, '^%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x(%d+):1$', 4 + n)
if not lease_end or #lease_end > 15 or tonumber(lease_end) < 1
    or tonumber(lease_end) >= (tonumber(ARGV[2]) or 0)
    or #KEYS ~= 1 or #ARGV ~= 3 then
  return redis.error_reply('ERR idem claim: expected 1 key, a pending record ("1P", '
    .. 'fingerprint length, fingerprint, 32 hex digit token, lease end below the ttl, ":1"), ttl ms, want_ttl')
end

-- A malformed TTL makes SET fail before it writes anything.
local rec = redis.pcall('SET', key, mine, 'NX', 'PX', ARGV[2], 'GET')
if not rec then
  return 1
end
if type(rec) == 'table' then
  -- WRONGTYPE: not a string, so not ours. Any other error (an ACL that
  -- does not grant SET, a bad TTL) goes back as it is.
  if string.find(rec.err or '', 'WRONGTYPE', 1, true) then
    return {7}
  end
  return rec
end

local fplen = string.byte(rec, 3)
if string.sub(rec, 1, 1) ~= '1' or not fplen or fplen > 32 or #rec < 3 + fplen then
  return {6, rec}
end
local stored_fp = string.sub(rec, 4, 3 + fplen)
local fp = string.sub(mine, 4, 3 + n)
-- An absent fingerprint on either side matches anything: only two known,
-- different payloads are a mismatch.
local mismatch = fp ~= '' and stored_fp ~= '' and fp ~= stored_fp
local state = string.sub(rec, 2, 2)

if state ~= 'P' then
  if not string.find('CZLU', state, 1, true) then
    return {6, rec}
  end
  if mismatch then
    return {5}
  end
  if ARGV[3] == '1' then
    return {3, rec, redis.call('PTTL', key)}
  end
  return {3, rec}
end

local owner = string.sub(rec, 4 + fplen, 35 + fplen)
local held_end, attempt = string.match(rec, '^(%d+):(%d+)$', 36 + fplen)
if #owner ~= 32 or not held_end then
  return {6, rec}
end
if mismatch then
  return {5}
end
-- Capped where the client's u32 saturates, so both stores agree.
attempt = math.min(tonumber(attempt), 4294967295)
local token = string.sub(mine, 4 + n, 35 + n)
if owner ~= token then
  local left = redis.call('PTTL', key) - tonumber(held_end)
  if left > 0 then
    return {4, left}
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
-- Either way the lease starts now: our record, with this attempt number.
-- '%d': a Lua number past 1e14 would print as "1e+14".
redis.call('SET', key, '1P' .. string.char(#fp) .. fp .. token
  .. string.format('%s:%d', lease_end, attempt), 'PX', ARGV[2])
return {1, attempt}
