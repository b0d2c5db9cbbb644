-- Extend: give our lease a new time to live, only if it is still ours.
-- KEYS[1]  the claimed key
-- ARGV[1]  our lease token
-- ARGV[2]  the new time to live, in milliseconds
-- Returns 1 when extended, 0 when the lease is no longer ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
