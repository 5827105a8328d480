# Third session, last call (warm machine, 2 GPUs): forge_dp with int8 state after the one-exchange change.
source benchmarks/gpu_env.sh; cd benchmarks; timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 2 dp_bench.py --mode speed --arms forge_dp --state int8 --models llama-3.1-8b --steps 8 --out $OUT/dp_speed_int8.json > $OUT/log.txt 2>&1
