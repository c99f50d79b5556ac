
-- The entry point of a check: a retry of a request that already counted
-- (its reply was lost) is admitted again; a blocked key denies (reply
-- {-1, time left µs}); otherwise the algorithm decides and counts an
-- admitted request. Every check replies
-- {allowed (1/0), spacing wait µs, then per rate: remaining, reset µs, wait µs}
-- as one string of these integers (`encode`), or an error.
bind(KEYS[1])
local again = retried()
if again then
  return encode(again)
end
local left = block_left()
if left then
  return encode({ -1, left })
end
local decided = decide(true)
if decided.err then
  return decided
end
return encode(decided)
