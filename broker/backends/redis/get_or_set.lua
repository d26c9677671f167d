-- The value of KEYS[1], set to ARGV[1] first when it is missing (the epoch, the partition count).
local value = redis.call('GET', KEYS[1])
if not value then
  redis.call('SET', KEYS[1], ARGV[1])
  value = ARGV[1]
end
return value
