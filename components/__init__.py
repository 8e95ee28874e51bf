"""Services that run inside every rank of train.py and eval.py, one concern per module:

* distributed.py: the process group, this rank's device, the DDP wrap, rank-0 decisions;
* checkpoint.py: TrainingState (one object encodes and decodes the whole checkpoint format),
  the atomic, digest-checked step checkpoints, and the resume rank 0 chooses for every rank;
  trained.py: a checkpoint's model and config for eval.py;
* train_step.py: one optimizer step (TrainStep), its metrics row, Progress (where training
  stands); loss_window.py: the train loss each rank sums between logged rows;
* metrics.py: RunLogger, rank 0's metrics.jsonl, W&B run and result.json however the run ends
  (result.json's fields follow from the events the loop reports);
  wandb_media.py: the W&B panels, image tables and checkpoint artifacts; console.py: what rank 0
  prints; repro.py: the run's command, packages and uncommitted diff;
* evaluation.py: exact distributed metrics (one all-reduce), for validation and eval.py;
  eval_record.py: eval.py's eval.json, plots and W&B run;
* optim.py, ema.py, monitor.py, precision.py: the optimizer and lr schedule, the weights' EMA,
  the monitored metric and early stopping, autocast and the GradScaler;
* speed.py, profiling.py: throughput, MFU and memory; torch.profiler (debug=profile);
* preemption.py: the agreed stop on SIGTERM/SIGUSR1; faults.py: fault injection for tests.

The torch-free modules they share with the launchers, data/ and models/ are in core/.
"""
