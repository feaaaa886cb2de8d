"""Names shared by strategies and clients: record keys and ConfigRecord keys.

Hyperparameters reach clients through the train/evaluate ``ConfigRecord``
under these constants; replies carry their numbers under the metric keys.
"""

# RecordDict keys
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

# ConfigRecord keys sent by every strategy
ALGORITHM = "algorithm"  # registry name of the client class to run
SERVER_ROUND = "server-round"
DATA_SPEC = "data-spec"  # JSON of fl_app.data.federated.DataSpec (simulation only)
MODEL_SPEC = "model-spec"  # JSON of fl_app.models.ModelSpec
LOCAL_EPOCHS = "local-epochs"
BATCH_SIZE = "batch-size"
LR = "lr"
MOMENTUM = "momentum"
SEED = "seed"  # run seed (training order, non-privacy randomness)
NOISE_SEED = "noise-seed"  # seed of privacy noise; absent with secure randomness
SECURE_RNG = "secure-rng"  # bool: draw privacy noise from OS entropy
DEVICE = "device"  # "cuda": train on the GPU Ray gave the client (absent: CPU; simulation.client_gpus)

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

# NbAFL
NBAFL_CLIP = "nbafl-clip"  # C: L2 bound of a client's whole uploaded parameter vector
NBAFL_SIGMA_UP = "nbafl-sigma-up"  # sigma_U: std of the uplink Gaussian noise per coordinate
NBAFL_MU = "nbafl-mu"  # FedProx proximal coefficient mu of local training (0: plain SGD)

# Laplace evaluation (clustering evaluation on inference results, strategies/laplace_eval.py)
PRIVACY_EVAL_TYPE = "privacy-eval-type"  # NOT_ENCRYPT | LAPLACE
LAPLACE_EVAL_EPS = "laplace-eval-eps"  # epsilon of the Laplace mechanism per report (as configured)
EVAL_SENSITIVITY = "eval-sensitivity"  # L1 sensitivity the client calibrates its noise with
INFERENCE_REPORTS = "inference-reports"  # reply ArrayRecord: the (noised) softmax vectors, nothing else

# PrivateKT
KT_INDICES = "privatekt-kt-indices"  # list[int]: the round's KT samples as rows of the public split
KT_SAMPLES = "privatekt-kt-samples"  # RecordDict key: ArrayRecord with the KT samples themselves
KT_SAMPLES_ARRAY = "x"  # the array inside KT_SAMPLES, shape (K, *input_shape)
KT_LABEL_EPSILON = "privatekt-label-epsilon"  # per-label randomized-response epsilon
KT_LABELS = "privatekt-labels"  # reply RecordDict key: ArrayRecord holding only the K perturbed labels
KT_LABELS_ARRAY = "labels"  # the array inside KT_LABELS: uint8, shape (K,), K raw bytes
KT_LABELS_STYPE = "raw"  # its serialisation type: the bytes are the labels (no .npy header)
# FedAvg+LDP (the PrivateKT baseline)
LDP_CLIP = "ldp-clip"  # C: L2 bound of a client's model update
LDP_NOISE_MULTIPLIER = "ldp-noise-multiplier"  # z: Gaussian std = z * 2C per coordinate

# DPFL-BNN
BNN_NOISE = "bnn-noise"  # bool: apply RR_gamma to the uploaded bits (false: the noise-free BNN baseline)
BNN_GAMMA = "bnn-gamma"  # RR_gamma: keep each bit w.p. 1/2 + gamma (only with bnn-noise)
BNN_BETA = "bnn-beta"  # beta: weight of the aggregate in W^i = beta W~ + (1 - beta) W-bar^i
BNN_LOCAL_STEPS = "bnn-local-steps"  # Adam steps per round (0: local-epochs passes over the data)
BNN_ADAM_BETA1 = "bnn-adam-beta1"  # Adam's first-moment coefficient (the document's "momentum")
BNN_ADAM_BETA2 = "bnn-adam-beta2"
BNN_NUM_BITS = "bnn-num-bits"  # d: binary weights per upload (the client checks its model against it)
BNN_EVAL_TEST_SUBSET = "bnn-eval-test-subset"  # local-model diagnostic: test examples (0: all)
BNN_PACKED_SIGNS = "packed-signs"  # ArrayRecord key of the uploaded uint8 bits
BNN_STATE_LATENT = "dpfl-bnn-latent"  # context.state ArrayRecord: latent weights W-bar^i
BNN_STATE_ADAM = "dpfl-bnn-adam"  # context.state ArrayRecord: Adam moments and step count
BNN_LOCAL_ACCURACY = "local-model-accuracy"  # metric: the client's own model on the test split

# KD-DP
KDDP_NOISE_MULTIPLIER = "kd-dp-noise-multiplier"  # z of local DP-SGD (noise std z * C on the sum)
KDDP_SAMPLING_RATE = "kd-dp-sampling-rate"  # q: Poisson sampling rate of every local example per step
KDDP_STEPS = "kd-dp-steps"  # DP-SGD steps this round
KDDP_CLIP = "kd-dp-clip"  # C: per-example L2 clip norm
KDDP_STAGE = "kd-dp-stage"  # "teacher" | "student"; replies echo the four mechanism keys above
