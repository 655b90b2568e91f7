"""The trainer house: `fastrl.train.trainer.Trainer` and its stages, as functions over explicit
state (`state.Run`, what a run is built from; `state.TrainState`, what training changes):

- `config`: TrainConfig; `cli_args`: the `fastrl train` options (fastrl/cli.py is the command);
- `build`: process group, device, model, task, loss config (`build`), then warm-up, reference /
  critic, optimizer and schedule, DDP / FSDP2, or a resume (`setup`);
- `rollout_phase`: supervised warm-up, one RL step's data (`collect`), greedy `evaluate`;
  `rollout`: generation with a KV cache and the fused sampler, log-probs of completions;
- `algos`: what differs between ppo, grpo and dapo (reward shaping, group filter, advantages,
  the critic);
- `update`: epochs x minibatches x micro-batches of the fused loss, one host read per update;
- `report`: the console, each step's metrics record and warnings; `runlog`: metrics.jsonl,
  TensorBoard, curves.png; `signals`: SIGINT / SIGTERM;
- `saving`: checkpoints of the TrainState and resume; `checkpoint`: the checkpoint files;
  `integrity`: atomic writes, umask, SHA256SUMS; `rundir`: the --out guard;
- `tasks`, `rewards` (built-in rewards, the scorer) and `reward_runners` / `_reward_worker`
  (where a reward call runs: a thread, or a worker process a timeout can kill).
"""
