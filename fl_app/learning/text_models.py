"""The text tasks' networks: the papers' LSTMs and a small causal transformer.

Each takes token ids ``(batch, length)`` and gives next-token scores ``(batch, length, vocabulary)``;
its factory takes ``(input_shape, num_classes)`` as every network does, with ``input_shape`` the
sequence length ``(length,)`` and ``num_classes`` the vocabulary's size (pad, words or characters,
out of vocabulary, beginning and end of sentence: :mod:`fl_app.data.text`).

* :class:`CharLSTM` (``char_lstm``): the Shakespeare network of McMahan et al. (AISTATS 2017), LEAF
  and Reddi et al. (ICLR 2021), as TFF builds it (google-research/federated
  ``utils/models/shakespeare_models.py``): an 8-dimensional embedding, two LSTM layers of 256 units,
  a dense layer to the vocabulary. 820,522 parameters for TFF's 90 symbols.
* :class:`WordLSTM` (``word_lstm``): the Stack Overflow network of Reddi et al. and of the DP-FTRL and
  matrix-factorization papers (``dp_matrix_factorization/dp_ftrl/models/stackoverflow_models.py``): a
  96-dimensional embedding, one LSTM of 670 units, a dense projection to 96, a dense layer to the
  10,004 tokens: 4,050,748 parameters, the count Reddi et al. report.
* :class:`CausalTransformer` (``causal_transformer``): a small one, two pre-norm blocks of masked
  self-attention (4 heads, width 64) and a 256-unit feed-forward layer, learned positions for the
  data's length.
* :class:`PflTransformer` (``pfl_transformer``): pfl-research's Stack Overflow transformer
  (apple/pfl-research ``benchmarks/model/pytorch/transformer.py``, ``lm_transformer`` with its
  ``benchmarks/lm/configs/baseline.yaml``: embedding and width 96, 3 post-norm layers of 8 heads,
  feed-forward 1536, ReLU, dropout 0.1, sinusoidal positions, output scores from the tied input
  embedding): 1,962,912 parameters for 10,004 tokens.
* :class:`PflLSTM` (``pfl_lstm``): pfl-research's LSTM (``benchmarks/model/pytorch/lstm.py``,
  ``lm_lstm`` with the sizes its configuration names: embedding 96, one LSTM of 256 with PyTorch's
  two bias vectors, a dense layer to 96, tied output): 1,347,552 parameters for 10,004 tokens.

The two pfl-research networks keep pfl-research's parameter names (``_embeddings.weight``,
``_transformer_encoder.layers.0.self_attn.in_proj_weight``, ...), so that a ``state_dict`` saved by
pfl-research loads into them as it is (less the transformer's positional-encoding buffer, which dpfl
computes instead of storing: a network with buffers cannot be clipped and noised as a whole), and
are written with plain operations so that the vectorised cohort trainer batches them
(``nn.TransformerEncoderLayer`` and ``nn.LSTM`` call fused kernels ``vmap`` cannot batch).
``benchmarks/pfl_crosscheck.py`` checks their outputs against pfl-research's own modules.

The LSTM layers are Keras's (one bias vector per layer, so the counts are the papers'): the forward
pass runs PyTorch's fused LSTM kernel, and under a ``torch.func`` transform (the vectorised cohort
trainer, per-example gradients) the same equations step by step, which ``vmap`` batches (its fused
kernel has no batching rule: ``vmap`` would run it once per client). Initialisation follows the
authors' Keras code: uniform(-0.05, 0.05) embeddings, He-normal input kernels, orthogonal recurrent
kernels, zero biases with the forget gate's at 1, Glorot-normal dense kernels.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

from fl_app.data.text_tokens import PAD
from fl_app.learning.probe import forward_probe


def sequence_length(name: str, input_shape: tuple[int, ...]) -> int:
    """The sequence length of ``input_shape`` (``ValueError`` naming ``name`` unless it is ``(length,)``)."""
    if len(input_shape) != 1 or int(input_shape[0]) < 1:
        raise ValueError(
            f"{name} takes token sequences of shape (length,) (the text data sets), not examples of "
            f"shape {tuple(input_shape)}"
        )
    return int(input_shape[0])


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``) is tracing this call.

    ``torch._C._are_functorch_transforms_active`` is private to torch; it is read here alone.
    """
    return bool(torch._C._are_functorch_transforms_active())


class LSTMLayer(nn.Module):
    """One LSTM layer with Keras's parameters (one bias vector), gates in PyTorch's order (i, f, g, o).

    ``(batch, length, input_size)`` to ``(batch, length, hidden_size)``, starting from zero states.
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(4 * hidden_size))
        nn.init.normal_(self.weight_ih, std=math.sqrt(2.0 / input_size))  # Keras HeNormal (untruncated)
        for gate in range(4):  # Keras Orthogonal on the recurrent kernel, one square block per gate
            nn.init.orthogonal_(self.weight_hh.data[gate * hidden_size : (gate + 1) * hidden_size])
        with torch.no_grad():
            self.bias[hidden_size : 2 * hidden_size] = 1.0  # Keras unit_forget_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden state at every position."""
        return lstm_states(x, self.weight_ih, self.weight_hh, self.bias, None, training=self.training)

    def unrolled(self, x: torch.Tensor) -> torch.Tensor:
        """The same equations as the fused kernel, one position at a time (what ``vmap`` can batch)."""
        return unrolled_lstm(x, self.weight_ih, self.weight_hh, self.bias)


def lstm_states(
    x: torch.Tensor,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
    bias_ih: torch.Tensor,
    bias_hh: torch.Tensor | None,
    *,
    training: bool,
) -> torch.Tensor:
    """An LSTM layer's hidden state at every position, from zero states (gates in the order i, f, g, o).

    PyTorch's fused kernel, or under a ``torch.func`` transform :func:`unrolled_lstm`; ``bias_hh``
    None: one bias vector (Keras's layer).
    """
    if transforms_active():
        return unrolled_lstm(x, weight_ih, weight_hh, bias_ih if bias_hh is None else bias_ih + bias_hh)
    zeros = x.new_zeros(1, x.shape[0], weight_hh.shape[1])
    flat = [weight_ih, weight_hh, bias_ih, torch.zeros_like(bias_ih) if bias_hh is None else bias_hh]
    output, _, _ = torch.lstm(x, (zeros, zeros), flat, True, 1, 0.0, training, False, True)
    return output


def unrolled_lstm(
    x: torch.Tensor, weight_ih: torch.Tensor, weight_hh: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The fused kernel's equations one position at a time (``bias``: the sum of the layer's biases)."""
    gates_x = F.linear(x, weight_ih, bias)
    hidden = weight_hh.shape[1]
    h = x.new_zeros(x.shape[0], hidden)
    c = x.new_zeros(x.shape[0], hidden)
    outputs = []
    for t in range(x.shape[1]):
        i, f, g, o = (gates_x[:, t] + F.linear(h, weight_hh)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, dim=1)


def keras_embedding(vocabulary: int, width: int) -> nn.Embedding:
    """An embedding initialised as Keras's (uniform in [-0.05, 0.05])."""
    embedding = nn.Embedding(vocabulary, width)
    nn.init.uniform_(embedding.weight, -0.05, 0.05)
    return embedding


def keras_dense(inputs: int, outputs: int) -> nn.Linear:
    """A dense layer initialised as Keras's ``Dense(kernel_initializer=GlorotNormal)`` (zero bias)."""
    layer = nn.Linear(inputs, outputs)
    nn.init.normal_(layer.weight, std=math.sqrt(2.0 / (inputs + outputs)))
    nn.init.zeros_(layer.bias)
    return layer


class CharLSTM(nn.Module):
    """The Shakespeare character LSTM: embedding 8, two LSTM layers of 256, dense to the vocabulary."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        sequence_length("char_lstm", input_shape)
        self.embedding = keras_embedding(num_classes, 8)
        self.lstm1 = LSTMLayer(8, 256)
        self.lstm2 = LSTMLayer(256, 256)
        self.output_layer = keras_dense(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token scores at every position."""
        return self.output_layer(self.lstm2(self.lstm1(self.embedding(x))))


class WordLSTM(nn.Module):
    """The Stack Overflow word LSTM: embedding 96, LSTM 670, projection to 96, dense to the vocabulary."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        sequence_length("word_lstm", input_shape)
        self.embedding = keras_embedding(num_classes, 96)
        self.lstm = LSTMLayer(96, 670)
        self.projection = keras_dense(670, 96)
        self.output_layer = keras_dense(96, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token scores at every position."""
        return self.output_layer(self.projection(self.lstm(self.embedding(x))))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and the positions before it."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally (plain operations: ``vmap`` batches every one of them)."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).unbind(dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(width // self.heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class CausalTransformer(nn.Module):
    """A small causal transformer: width 64, 2 blocks of 4 heads, learned positions for the data's length."""

    WIDTH, HEADS, HIDDEN, BLOCKS = 64, 4, 256, 2

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.max_length = sequence_length("causal_transformer", input_shape)
        self.embedding = keras_embedding(num_classes, self.WIDTH)
        self.positions = nn.Parameter(torch.empty(self.max_length, self.WIDTH).uniform_(-0.05, 0.05))
        self.blocks = nn.Sequential(
            *(TransformerBlock(self.WIDTH, self.HEADS, self.HIDDEN) for _ in range(self.BLOCKS))
        )
        self.norm = nn.LayerNorm(self.WIDTH)
        self.output_layer = keras_dense(self.WIDTH, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token scores at every position (at most ``max_length`` positions)."""
        if x.shape[-1] > self.max_length:
            raise ValueError(
                f"causal_transformer was built for sequences of at most {self.max_length} tokens, "
                f"got {x.shape[-1]}"
            )
        h = self.embedding(x) + self.positions[: x.shape[-1]]
        return self.output_layer(self.norm(self.blocks(h)))


def positional_encoding(length: int, depth: int) -> np.ndarray:
    """The sinusoidal positions of Vaswani et al. (2017), Sec. 3.5: ``(length, depth)``, float32.

    Computed as pfl-research computes them (``benchmarks/model/numpy/layer.py``): float64 angles,
    sines in the even columns and cosines in the odd ones, stored as float32.
    """
    positions = np.arange(length)[:, np.newaxis]
    frequencies = np.exp(np.arange(0, depth, 2) * (-np.log(10000.0) / depth))
    encoding = np.zeros((length, depth), dtype=np.float32)
    encoding[:, 0::2] = np.sin(positions * frequencies)
    encoding[:, 1::2] = np.cos(positions * frequencies)
    return encoding


class MultiheadSelfAttention(nn.Module):
    """``nn.MultiheadAttention``'s self-attention, its parameters, in plain operations.

    ``in_proj_weight`` ``(3 width, width)`` and ``in_proj_bias`` give the queries, keys and values,
    ``out_proj`` joins the heads; the attention weights go through dropout as PyTorch's do.
    """

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        self.attention_dropout = nn.Dropout(dropout)
        nn.init.xavier_uniform_(self.in_proj_weight)  # as nn.MultiheadAttention._reset_parameters
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        """Attend where ``future`` (``(length, length)``, True: masked) allows."""
        batch, length, width = x.shape
        head = width // self.heads
        q, k, v = (
            F.linear(x, self.in_proj_weight, self.in_proj_bias)
            .view(batch, length, 3, self.heads, head)
            .unbind(dim=2)
        )
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head)
        weights = self.attention_dropout(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1))
        return self.out_proj(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width))


class PostNormEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (post-norm, ReLU, batch first), its parameter names, plain operations.

    ``norm1(x + dropout1(attention(x)))``, then ``norm2(x + dropout2(linear2(dropout(relu(linear1(x))))))``.
    """

    def __init__(self, width: int, heads: int, feed_forward: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = MultiheadSelfAttention(width, heads, dropout)
        self.linear1 = nn.Linear(width, feed_forward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(feed_forward, width)
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        """One layer."""
        x = self.norm1(x + self.dropout1(self.self_attn(x, future)))
        return self.norm2(x + self.dropout2(self.linear2(self.dropout(F.relu(self.linear1(x))))))


class EncoderStack(nn.Module):
    """``nn.TransformerEncoder``: ``count`` copies of one initialised layer (PyTorch deep-copies it)."""

    def __init__(self, layer: PostNormEncoderLayer, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(count))

    def forward(self, x: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        """Every layer in turn."""
        for layer in self.layers:
            x = layer(x, future)
        return x


class PflTransformer(nn.Module):
    """pfl-research's Stack Overflow transformer (its ``lm_transformer`` at its LM configuration's sizes).

    Embedding and width 96 (so no projections), 3 post-norm layers of 8 heads, feed-forward 1536,
    dropout 0.1, causal attention, sinusoidal positions added to the embedding scaled by
    ``sqrt(96)``, scores ``x @ embedding.T`` (the output layer is the input embedding). The pad
    (token 0) is the embedding's ``padding_idx``, as in pfl-research.
    """

    EMBEDDING, HEADS, FEED_FORWARD, LAYERS, DROPOUT = 96, 8, 1536, 3, 0.1

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.max_length = sequence_length("pfl_transformer", input_shape)
        self._embeddings = nn.Embedding(num_classes, self.EMBEDDING, padding_idx=PAD)
        nn.init.uniform_(self._embeddings.weight, -0.05, 0.05)  # pfl-research's _init_weights
        layer = PostNormEncoderLayer(self.EMBEDDING, self.HEADS, self.FEED_FORWARD, self.DROPOUT)
        self._transformer_encoder = EncoderStack(layer, self.LAYERS)
        self.positions = torch.from_numpy(positional_encoding(self.max_length, self.EMBEDDING))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Next-token scores at every position (at most ``max_length`` positions)."""
        length = inputs.shape[-1]
        if length > self.max_length:
            raise ValueError(
                f"pfl_transformer was built for sequences of at most {self.max_length} tokens, got {length}"
            )
        x = self._embeddings(inputs) * math.sqrt(self.EMBEDDING)
        x = x + self.positions[:length].to(device=x.device, dtype=x.dtype)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        x = self._transformer_encoder(x, future)
        return x @ self._embeddings.weight.t()


class TorchLSTM(nn.Module):
    """``nn.LSTM`` of one layer (batch first): its parameter names, two bias vectors, zero initial states."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(hidden_size)
        self.weight_ih_l0 = nn.Parameter(torch.empty(4 * hidden_size, input_size).uniform_(-bound, bound))
        self.weight_hh_l0 = nn.Parameter(torch.empty(4 * hidden_size, hidden_size).uniform_(-bound, bound))
        self.bias_ih_l0 = nn.Parameter(torch.empty(4 * hidden_size).uniform_(-bound, bound))
        self.bias_hh_l0 = nn.Parameter(torch.empty(4 * hidden_size).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden state at every position."""
        return lstm_states(
            x, self.weight_ih_l0, self.weight_hh_l0, self.bias_ih_l0, self.bias_hh_l0, training=self.training
        )


class PflLSTM(nn.Module):
    """pfl-research's LSTM (its ``lm_lstm``): embedding 96, an LSTM of 256, dense to 96, the tied output.

    Initialised as pfl-research's: the embedding PyTorch's default (normal, the pad row zero), the
    input kernel Glorot-uniform, the recurrent kernel orthogonal, biases and the dense layer PyTorch's
    defaults.
    """

    EMBEDDING, CELLS = 96, 256

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        sequence_length("pfl_lstm", input_shape)
        self._embeddings = nn.Embedding(num_classes, self.EMBEDDING, padding_idx=PAD)
        self._lstms = nn.ModuleList([TorchLSTM(self.EMBEDDING, self.CELLS)])
        self._intermediate = nn.Linear(self.CELLS, self.EMBEDDING)
        for lstm in self._lstms:
            nn.init.xavier_uniform_(lstm.weight_ih_l0)
            nn.init.orthogonal_(lstm.weight_hh_l0)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Next-token scores at every position."""
        x = self._embeddings(inputs)
        for lstm in self._lstms:
            x = lstm(x)
        return self._intermediate(x) @ self._embeddings.weight.t()


#: The registered names of the next-token networks (``model=auto`` picks the first two).
TEXT_MODELS = {
    "char_lstm": CharLSTM,
    "word_lstm": WordLSTM,
    "causal_transformer": CausalTransformer,
    "pfl_transformer": PflTransformer,
    "pfl_lstm": PflLSTM,
}
#: A vocabulary of at most this many tokens is one of characters: ``model=auto`` trains the char LSTM.
CHARACTER_VOCABULARY = 256


def auto_text_model(vocabulary: int) -> str:
    """``model=auto`` on a text data set: the char LSTM for characters, the word LSTM for words."""
    return "char_lstm" if vocabulary <= CHARACTER_VOCABULARY else "word_lstm"


def check_text_model_fits(network: nn.Module, name: str, example: np.ndarray, vocabulary: int) -> None:
    """One forward pass of the token sequence ``example`` ``(1, length)``; ``ValueError`` unless it fits.

    Fits: the network takes the sequence and gives ``(1, length, vocabulary)`` scores. The message is
    one line naming the network, the sequence length and the vocabulary.
    """
    length = int(example.shape[-1])
    batch = torch.from_numpy(np.asarray(example, dtype=np.int64))
    takes = f"token sequences of length {length} (vocabulary of {vocabulary})"
    output = forward_probe(network, batch, name, takes)
    expected = (1, length, vocabulary)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"the network {name!r} gives {got} for one sequence of {length} tokens; it must give next-token "
            f"scores of shape {expected} (the data's vocabulary has {vocabulary} tokens)"
        )
