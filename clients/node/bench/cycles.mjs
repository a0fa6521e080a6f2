#!/usr/bin/env node
// What the Node client costs: CPU time and peak memory of this process for CYCLES (default 1,000)
// acquire/renew/release cycles, one after another, against HELIX_LOCKS_URL (HELIX_LOCKS_API_KEY).
// bench/cycles.py does the same with the Python SDK. Run both against the same service:
//   node bench/cycles.mjs [CYCLES]    (after npm run build)
//   python bench/cycles.py [CYCLES]   (in the project's .venv)
// Prints one JSON line; CPU time and peak RSS are the whole process's, start-up included.
import { LockClient } from "../dist/index.js";

const cycles = Number(process.argv[2] ?? 1000);
const organizationId = process.env.BENCH_ORG ?? "acme";
const jobType = `bench-node-${process.pid}`;
const client = new LockClient();
const started = performance.now();
for (let i = 0; i < cycles; i++) {
  const grant = await client.acquire({ organizationId, jobType, ttl: 30 });
  await client.renew(grant);
  await client.release(grant);
}
const wall = (performance.now() - started) / 1000;
const cpu = process.cpuUsage(); // since the process started, in µs
console.log(
  JSON.stringify({
    client: `node ${process.version}`,
    cycles,
    wall_seconds: Number(wall.toFixed(2)),
    cycles_per_second: Math.round(cycles / wall),
    cpu_seconds: Number(((cpu.user + cpu.system) / 1e6).toFixed(2)),
    cpu_ms_per_cycle: Number(((cpu.user + cpu.system) / 1e3 / cycles).toFixed(3)),
    peak_rss_mib: Number((process.resourceUsage().maxRSS / 1024).toFixed(1)),
  }),
);
