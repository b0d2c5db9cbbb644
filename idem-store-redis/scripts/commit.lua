-- Commit: turn this transaction's lease into a done-mark kept for the retention period
-- (compare-and-set on the lease token).
-- KEYS[1]  the claimed key
-- ARGV[1]  our lease token
-- ARGV[2]  the done-mark value
-- ARGV[3]  the retention, in milliseconds
-- Returns 1 when committed: the lease was ours, or it had expired and nobody else holds the
--           key (the work is done, so marking it done is true, and spares a second run);
--         2 when the key was already done (another worker committed it): nothing changes;
--         0 when another worker holds a live lease on the key: ours was lost.
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] or v == false then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
if v == ARGV[2] then
  return 2
end
return 0
