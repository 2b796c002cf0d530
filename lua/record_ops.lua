-- The record operations the write scripts share: the pending body's
-- parsers, the guarded read and owner check, the complete step and the
-- wake-up. Joined after prelude.lua (idem-redis/src/store/scripts.rs):
-- at a script's top level for the scripts that always use them, inside a
-- function for complete_batch, whose common path needs none of them. A
-- script's top level runs on every call, and each closure made there
-- costs the server its upvalues (about 7,000 instructions for these).

-- Walks the finished steps of a pending record (run_steps), from pos to the
-- end: each is "|" NAMELEN ":" NAME VALUELEN ":" VALUE, lengths decimal,
-- or the waiter mark (NAMELEN and VALUELEN 0). Returns nil when they are
-- malformed; else true, whether one of them is named `name` (when given),
-- and whether the mark is among them.
local function steps_find(rec, pos, name)
  local found, waited = false, false
  while pos <= #rec do
    local nl, p = string.match(rec, '^|(%d+):()', pos)
    if not nl or #nl > 9 then
      return nil
    end
    nl = tonumber(nl)
    local vl, q = string.match(rec, '^(%d+):()', p + nl)
    if not vl or #vl > 9 then
      return nil
    end
    if nl == 0 then
      if tonumber(vl) ~= 0 then
        return nil
      end
      waited = true
    elseif name and string.sub(rec, p, p + nl - 1) == name then
      found = true
    end
    pos = q + tonumber(vl)
  end
  if pos ~= #rec + 1 then
    return nil
  end
  return true, found, waited
end

-- A pending record's owner token, lease end and attempt (both digit
-- strings), its steps (the tail after ATTEMPT, '' when none, the waiter
-- mark included) and whether it carries the mark, or nil when the body is
-- malformed.
local function pending(rec, n)
  local owner = string.sub(rec, 4 + n, 35 + n)
  local lease_end, attempt, at = string.match(rec, '^(%d+):(%d+)()', 36 + n)
  if #owner ~= 32 or not lease_end then
    return nil
  end
  local ok, _, waited = steps_find(rec, at)
  if not ok then
    return nil
  end
  return owner, lease_end, attempt, string.sub(rec, at), waited
end

-- An error reply from redis.pcall: WRONGTYPE as its code (not our key),
-- anything else (an ACL refusal, OOM) passed back as it is.
local function failed(reply)
  if string.find(reply.err or '', 'WRONGTYPE', 1, true) then
    return WRONG_TYPE
  end
  return reply
end

-- The caller's pending record at key: rec, fplen, lease end, attempt, steps,
-- whether a waiter marked it. Or
-- nil and the reply code that says why not (or the error to pass back),
-- then the record itself when it is completed.
local function owned(key, token)
  local rec = redis.pcall('GET', key)
  if type(rec) == 'table' then
    return nil, failed(rec)
  end
  if not rec then
    return nil, MISSING
  end
  local state, n = header(rec)
  if not state then
    return nil, UNREADABLE
  end
  if state ~= PENDING then
    return nil, COMPLETED, rec, n
  end
  local owner, lease_end, attempt, steps, waited = pending(rec, n)
  if not owner then
    return nil, UNREADABLE
  end
  if owner ~= token then
    return nil, OTHER_OWNER
  end
  return rec, n, lease_end, attempt, steps, waited
end


-- A complete of key by token with the completed record rec (of kind and
-- fingerprint length n), up to its write (complete.lua, complete_batch.lua):
-- the reply when nothing is to be written; else nil, the record to write
-- and whether a waiter marked ours.
local function completing(key, token, rec, kind, n)
  local old, on, done, dn, _, waited = owned(key, token)
  if not old then
    -- Completed already. Holding exactly this result, it is this same
    -- complete sent again (a reply lost, the connection re-sent it): done.
    -- A different result means another holder took over and stored its own.
    if on == COMPLETED and string.sub(done, 2, 2) == kind
        and string.sub(done, 4 + dn) == string.sub(rec, 4 + n) then
      return DONE
    end
    return on
  end
  -- Ours. The completed record keeps the claim's fingerprint.
  if on ~= n or (n > 0 and string.sub(old, 4, 3 + on) ~= string.sub(rec, 4, 3 + n)) then
    rec = '1' .. kind .. string.char(on) .. string.sub(old, 4, 3 + on) .. string.sub(rec, 4 + n)
  end
  return nil, rec, waited
end

-- Wakes the processes waiting on key (Call::wait): a sharded publish on the
-- channel named as the key, so on a cluster it stays on the key's slot.
-- complete calls it only for a record a waiter marked (WAITED); release,
-- suspend and forget always (they are rare).
-- pcall: an ACL that denies SPUBLISH or the channel, or a server without
-- sharded pub/sub, must not fail the write (waiters then poll).
local function notify(key, what)
  redis.pcall('SPUBLISH', key, what)
end
