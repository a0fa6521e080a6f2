-- bench/run.py's cross-check: wrk -t N -c N, a thread per connection, so request() and
-- response() alternate and each thread cycles acquire + release on a key of its own.
-- Arguments: the API key, the key prefix.
local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  auth = "Bearer " .. args[1]
  local body = string.format(
    '{"organization_id":"bench","job_type":"%s-%d","holder":"wrk","ttl_seconds":30}', args[2], id)
  acquire = wrk.format("POST", "/v1/locks", {["Authorization"] = auth, ["Content-Type"] = "application/json"}, body)
  held, cycles, failures = nil, 0, 0
end

function request()
  if held then
    local release = wrk.format("DELETE", "/v1/locks/" .. held.id, {["Authorization"] = auth, ["Lock-Token"] = held.token})
    held = nil
    return release
  end
  return acquire
end

function response(status, headers, body)
  if status == 201 then
    held = {id = body:match('"id":(%d+)'), token = body:match('"token":"(%x+)"')}
  elseif status == 204 then
    cycles = cycles + 1
  else
    failures = failures + 1
  end
end

function done(summary, latency, requests)
  local total, failed = 0, 0
  for _, thread in ipairs(threads) do
    total = total + thread:get("cycles")
    failed = failed + thread:get("failures")
  end
  local errors = summary.errors  -- sockets: a cycle cut by one leaves its key taken
  failed = failed + errors.connect + errors.read + errors.write + errors.timeout
  io.write(string.format('RESULT {"cycles": %d, "failures": %d, "seconds": %f, "p50_ms": %f, "p99_ms": %f}\n',
    total, failed, summary.duration / 1e6, latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
