-- Rollback: delete the lease only if it is still ours (compare-and-delete on the token).
-- KEYS[1]  the claimed key
-- ARGV[1]  our lease token
-- Returns 1 when deleted, 0 when the key holds something else (expired, taken over, done).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
