-- Give back the costs of batched window-counter checks that were counted
-- first and then denied (src/store/redis/plain.rs), atomically:
-- KEYS     the counts
-- ARGV     each count's cost to take off
-- A count at zero or below is deleted: the count was reset, rewarded or
-- expired with its window since it was counted, so nothing of the denied
-- requests is left in it, and no count is ever left negative or without
-- its expiry (DECRBY keeps a key's expiry; it would create a missing one
-- without).
for i = 1, #KEYS do
  if redis.call('DECRBY', KEYS[i], ARGV[i]) <= 0 then
    redis.call('DEL', KEYS[i])
  end
end
return #KEYS
