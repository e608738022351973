"""distcourse on Amazon SageMaker: a PyTorch estimator runs `distcourse.train` with torchrun on each instance.

NOT TESTED HERE (no cloud account, and `sagemaker` is not a dependency): adapt the role, instance type,
framework version and S3 paths. What is tested is the same trainer on several processes and two loopback
"nodes" (nbs/10_launch.ipynb). Run this file from the repository root on a machine with AWS credentials:

    pip install sagemaker && python scripts/cloud/sagemaker_estimator.py
"""
from sagemaker.pytorch import PyTorch

estimator = PyTorch(
    entry_point="sagemaker_entry.py",       # calls distcourse.train.main(); its CLI flags come from `hyperparameters`
    source_dir="scripts/cloud",             # uploaded with the job; requirements.txt there installs distcourse
    role="arn:aws:iam::<account>:role/<sagemaker-execution-role>",
    framework_version="2.5",                # a PyTorch container version SageMaker offers
    py_version="py311",
    instance_count=2,                       # nodes
    instance_type="ml.p4d.24xlarge",        # 8 A100s each: 16 processes in all
    distribution={"torch_distributed": {"enabled": True}},  # torchrun on every instance: WORLD_SIZE, RANK set
    hyperparameters={"model": "base", "mixed_precision": "bf16", "batch_size": 16, "max_steps": 5000,
                     "save_every": 200, "output_dir": "/opt/ml/checkpoints/run"},  # --flag value each
    checkpoint_s3_uri="s3://<bucket>/distcourse/checkpoints",  # /opt/ml/checkpoints is synced: spot restarts resume
    use_spot_instances=True, max_run=4 * 3600, max_wait=8 * 3600,
)
estimator.fit()  # no input channels: the offline corpus is built on the instances (or pass --dataset <hub id>)
