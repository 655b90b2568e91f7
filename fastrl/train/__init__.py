"""The pieces of `fastrl.train.trainer.Trainer`, one module per stage of the data flow:

- `build`: distributed setup, device, model, loss config, optimizer and schedule, DDP / FSDP2;
- `rollout_phase`: supervised warm-up, generation, scoring, evaluation (`collect`, `evaluate`);
- `algos`: what differs between ppo, grpo and dapo (reward shaping, group filter, advantages,
  the critic);
- `update`: epochs x minibatches x micro-batches of the fused loss, one host read per update;
- `state`: checkpoints, resume, the Hugging Face export, the --out guard;
- `runlog`: metrics.jsonl, TensorBoard, curves.png.
"""
