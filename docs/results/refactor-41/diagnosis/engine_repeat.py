import time, sys, torch
torch.set_num_threads(1)
from load_tests.bench.common import engine_for, greedy_requests, make_prompts, run_to_completion
from actors.zoo import zoo
import inspect
paths = {f"m{i}": zoo.ensure_model("llama-tiny-a") for i in range(4)}
prompts = make_prompts(4, 64, seed=2)
kw = dict(num_slots=3, tokens_per_model=4 * (64 + 32), device=torch.device("cpu"), dtype=None, host_cache=None)
if "kernels" in inspect.signature(engine_for).parameters: kw["kernels"] = "fast"
engine = engine_for(paths, **kw)
out = []
for i in range(int(sys.argv[1])):
    reqs = [r for n in paths for r in greedy_requests(n, prompts, 32, f"r{i}")]
    c0, w0 = time.process_time(), time.perf_counter()
    run_to_completion(engine, reqs)
    out.append((round(time.process_time() - c0, 3), round(time.perf_counter() - w0, 3)))
print(out[:3], out[-3:])
