"""Names every strategy and client share: record keys and the common ConfigRecord keys.

Hyperparameters reach clients through the train/evaluate ``ConfigRecord`` under these constants;
replies carry their numbers under the metric keys. An algorithm's own keys are its wire protocol and
live in its client module (``clients/<name>.py``), which its strategy imports.
"""

# RecordDict keys
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

# ConfigRecord keys sent by every strategy
ALGORITHM = "algorithm"  # registry name of the client class to run
SERVER_ROUND = "server-round"
DATA_SPEC = "data-spec"  # JSON of fl_app.data.federated.DataSpec (simulation only)
MODEL_SPEC = "model-spec"  # JSON of fl_app.learning.model_spec.ModelSpec
LOCAL_EPOCHS = "local-epochs"
BATCH_SIZE = "batch-size"
LR = "lr"
MOMENTUM = "momentum"
SEED = "seed"  # run seed (training order, non-privacy randomness)
NOISE_SEED = "noise-seed"  # seed of privacy noise; absent with secure randomness
SECURE_RNG = "secure-rng"  # bool: draw privacy noise from OS entropy
VECTORISE = "vectorise"  # True: an actor trains the batch's train messages as one computation
DEVICE = "device"  # "cuda": train on the GPU Ray gave the client (absent: CPU; simulation.client_gpus)

# Packed messages (fl_app.engine.packed): the members of one message, and what failed of them
PACKED = "packed"
PACKED_FAILURES = "packed-failures"
REPLY_SUM = "reply-sum"  # in the packed record: JSON of the strategy's per-client term (fl_app.learning.sums)

# Metric keys in replies
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-accuracy"
PARTITION_ID = "partition-id"

# Query (roster) message
QUERY_ROSTER = "roster"

# node_config keys
NODE_PARTITION_ID = "partition-id"
NODE_NUM_PARTITIONS = "num-partitions"
NODE_DATA_PATH = "data-path"
