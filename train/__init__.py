"""Training program for the tensor-parallel GPT: `python -m train`, or `train.run(config)`."""
from train.config import Config, load_config
from train.errors import TrainError
from train.loop import RunDirInUse, build, make_train_step, run

__all__ = ["Config", "RunDirInUse", "TrainError", "build", "load_config", "make_train_step",
           "run"]
