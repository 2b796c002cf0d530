-- idem's record format for the scripts: joined in front of each script at
-- build time (idem-redis/src/store/scripts.rs), so it is written once;
-- record_ops.lua, the readers and checks the write scripts share, follows
-- it.
-- The format is described in lua/README.md; its Rust side is
-- idem-redis/src/store/record.rs, and a test checks the two agree.

-- Reply codes (Rust: record::Code).
local MISSING, DONE, OTHER_OWNER, COMPLETED, IN_PROGRESS, MISMATCH, UNREADABLE, WRONG_TYPE =
  0, 1, 2, 3, 4, 5, 6, 7
-- State bytes: pending, and the completed kinds (Rust: ValueKind::tag).
local PENDING = 'P'
-- The waiter mark of a pending record (Rust: record::WAITED): a step with
-- an empty name and an empty value among its steps, written by the claim
-- of a caller subscribed to the key, so that complete publishes only then.
-- A step's shape, so parsers from before the mark read such a record.
local WAITED = '|0:0:'

-- The record's state byte and fingerprint length, or nil when it is not a
-- record of this format version ("1").
-- Comparisons against constants, not a table of the states: a script's
-- top level runs on every call, and building a table there cost each
-- call about 2,000 server instructions (lua/README.md).
local function header(rec)
  local v, s, n = string.byte(rec, 1, 3)
  local state
  if s == 80 then
    state = PENDING
  elseif s == 67 then
    state = 'C'
  elseif s == 90 then
    state = 'Z'
  elseif s == 76 then
    state = 'L'
  elseif s == 85 then
    state = 'U'
  end
  if v ~= 49 or not state or not n or n > 32 or #rec < 3 + n then
    return nil
  end
  return state, n
end
