"""The run directory, the floor every process of a run stands on (DESIGN §2-3).

  handoff         versioned entries: write temp, fsync, manifest last, rename; verified reads
  batch           the trainer's input format (RUN/rollouts/step-N)
  safetensors_io  the weights file format: streamed reads into reused buffers, piece writes
  layout          where a run lives, its tree, preparing it and trimming it for --resume
  heartbeat       what each process is doing now (RUN/heartbeat), read by the watchdog
  process         what every child does the same way (die with its parent)

Everything above (trainer, inference, rollout, launch) exchanges data only through these.
"""
