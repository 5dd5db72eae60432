"""`HeadwiseMLP`: the module of the `"mlp"` mapper kind, one small MLP per target KV head, heads batched.

The paper (docs/method.md, "The MLP variant"): on the same inputs as the ridge (content-space keys or values of the
selected source layers, all KV heads concatenated), each target KV head gets `Linear(d_in -> h), ReLU, Linear(h -> h),
ReLU, Linear(h -> d_head)`. Training lives in `hf_kvmap.kinds.mlp`.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class HeadwiseMLP(nn.Module):
    r"""
    One MLP per target KV head, `Linear(d_in -> h), ReLU, Linear(h -> h), ReLU, Linear(h -> d_head)`, heads batched.

    Every head reads the same input features (the selected source layers, all their KV heads); head `i` writes output
    columns `i * head_dim : (i + 1) * head_dim`, i.e. the output is flattened over `(head, dim)` like the ridge map's.
    Parameters are stored per head, `weight_*` `(heads, in, out)` and `bias_*` `(heads, out)`; the forward is one GEMM
    for the first layer (all heads share the input) and two `torch.baddbmm` for the others.

    Args:
        in_features (`int`): `d_in`, the width of the input features.
        hidden_size (`int`): `h`, the width of both hidden layers.
        num_heads (`int`): target KV heads.
        head_dim (`int`): target head dim.
        device, dtype (*optional*): where and in which dtype to allocate the parameters.

    Initialization (`reset_parameters`, called by `__init__`, draws from torch's global RNG so `torch.manual_seed`
    makes it deterministic): He-uniform weights for the two ReLU layers, `U(+-1/sqrt(h))` for the output layer, zero
    biases. `PreTrainedModel._init_weights` (transformers 5.23) leaves modules with plain `nn.Parameter`s alone, so
    this init survives `MapperModel.post_init`.

    Example:

    ```python
    >>> import torch
    >>> from hf_kvmap.modeling_mlp import HeadwiseMLP
    >>> _ = torch.manual_seed(0)
    >>> mlp = HeadwiseMLP(in_features=64, hidden_size=32, num_heads=2, head_dim=16)
    >>> mlp(torch.randn(3, 5, 64)).shape
    torch.Size([3, 5, 32])
    ```
    """

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, value in (
            ("in_features", in_features),
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        self.in_features, self.hidden_size = in_features, hidden_size
        self.num_heads, self.head_dim = num_heads, head_dim
        factory = {"device": device, "dtype": dtype}
        self.weight_in = nn.Parameter(torch.empty(num_heads, in_features, hidden_size, **factory))
        self.bias_in = nn.Parameter(torch.empty(num_heads, hidden_size, **factory))
        self.weight_hidden = nn.Parameter(torch.empty(num_heads, hidden_size, hidden_size, **factory))
        self.bias_hidden = nn.Parameter(torch.empty(num_heads, hidden_size, **factory))
        self.weight_out = nn.Parameter(torch.empty(num_heads, hidden_size, head_dim, **factory))
        self.bias_out = nn.Parameter(torch.empty(num_heads, head_dim, **factory))
        self.reset_parameters()

    @property
    def out_features(self) -> int:
        return self.num_heads * self.head_dim

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}"
        )

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random init (see the class docstring); `generator` defaults to torch's global RNG."""
        if self.weight_in.device.type == "meta":
            return
        for weight, fan_in, gain in (
            (self.weight_in, self.in_features, math.sqrt(2.0)),
            (self.weight_hidden, self.hidden_size, math.sqrt(2.0)),
            (self.weight_out, self.hidden_size, 1.0),
        ):
            bound = gain * math.sqrt(3.0 / fan_in)
            weight.uniform_(-bound, bound, generator=generator)
        for bias in (self.bias_in, self.bias_hidden, self.bias_out):
            bias.zero_()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """`(..., in_features)` -> `(..., num_heads * head_dim)` (head-major, like the ridge map)."""
        if features.shape[-1] != self.in_features:
            raise ValueError(f"HeadwiseMLP expects {self.in_features} input features, got {features.shape[-1]}.")
        lead = features.shape[:-1]
        x = features.reshape(-1, self.in_features)
        heads, hidden = self.num_heads, self.hidden_size
        # Layer 1: every head reads the same input, so all heads are one GEMM against (in, heads * hidden).
        weight_in = self.weight_in.permute(1, 0, 2).reshape(self.in_features, heads * hidden)
        h = torch.addmm(self.bias_in.reshape(-1), x, weight_in).relu_()
        h = h.view(-1, heads, hidden).transpose(0, 1)  # (heads, n, hidden)
        h = torch.baddbmm(self.bias_hidden.unsqueeze(1), h, self.weight_hidden).relu_()
        out = torch.baddbmm(self.bias_out.unsqueeze(1), h, self.weight_out)  # (heads, n, head_dim)
        return out.transpose(0, 1).reshape(*lead, self.out_features)

    @torch.no_grad()
    def init_from_ridge(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> HeadwiseMLP:
        r"""
        Make the MLP compute exactly the affine map `x @ weight.T + bias` (a ridge solution); other units stay random.

        Per head, hidden units `0..d-1` of layer 1 compute `relu(y)` and units `d..2d-1` compute `relu(-y)` of the
        head's affine output `y`; layer 2 passes these `2 d` units through unchanged (an identity block; inputs are
        already non-negative) and the output layer returns `relu(y) - relu(-y) = y`. The other `h - 2 d` units keep
        their random init but enter the output with zero weight, so training starts exactly at the ridge solution and
        can only add to it. Needs `hidden_size >= 2 * head_dim`.

        Args:
            weight (`torch.Tensor`): `(num_heads * head_dim, in_features)`, `nn.Linear` layout.
            bias (`torch.Tensor`, *optional*): `(num_heads * head_dim,)`; zeros when omitted.

        Returns:
            `self`.
        """
        heads, dim, hidden = self.num_heads, self.head_dim, self.hidden_size
        if hidden < 2 * dim:
            raise ValueError(
                f"init_from_ridge needs hidden_size >= 2 * head_dim = {2 * dim} to pass the linear map through the "
                f"ReLUs exactly, but hidden_size={hidden}; use a larger hidden size or a random init."
            )
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"Ridge weight has shape {tuple(weight.shape)}; expected {(self.out_features, self.in_features)}."
            )
        if bias is None:
            bias = torch.zeros(self.out_features)
        if tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"Ridge bias has shape {tuple(bias.shape)}; expected {(self.out_features,)}.")
        like = {"device": self.weight_in.device, "dtype": self.weight_in.dtype}
        per_head = weight.to(**like).view(heads, dim, self.in_features).transpose(1, 2)  # (heads, in, dim)
        bias = bias.to(**like).view(heads, dim)
        self.weight_in[:, :, :dim] = per_head
        self.weight_in[:, :, dim : 2 * dim] = -per_head
        self.bias_in[:, :dim] = bias
        self.bias_in[:, dim : 2 * dim] = -bias
        self.weight_hidden[:, :, : 2 * dim] = 0
        self.weight_hidden[:, : 2 * dim, : 2 * dim] = torch.eye(2 * dim, **like)
        self.bias_hidden[:, : 2 * dim] = 0
        eye = torch.eye(dim, **like)
        self.weight_out.zero_()
        self.weight_out[:, :dim] = eye
        self.weight_out[:, dim : 2 * dim] = -eye
        self.bias_out.zero_()
        return self

    @torch.no_grad()
    def fold_affine(
        self,
        in_mean: torch.Tensor,
        in_scale: torch.Tensor,
        out_mean: torch.Tensor,
        out_scale: torch.Tensor | float,
    ) -> HeadwiseMLP:
        r"""
        Fold input standardization and output de-standardization into the weights (exact up to float rounding).

        If the MLP maps standardized inputs `(x - in_mean) / in_scale` to standardized outputs `(y - out_mean) /
        out_scale`, afterwards it maps raw `x` to raw `y`. Computed in float64.

        Args:
            in_mean, in_scale (`torch.Tensor`): `(in_features,)`.
            out_mean (`torch.Tensor`): `(num_heads * head_dim,)`.
            out_scale (`torch.Tensor` or `float`): a scalar, or `(num_heads * head_dim,)`.
        """
        dtype = self.weight_in.dtype
        f64 = {"device": self.weight_in.device, "dtype": torch.float64}
        in_mean, in_scale = in_mean.to(**f64), in_scale.to(**f64)
        out_mean = out_mean.to(**f64).view(self.num_heads, self.head_dim)
        out_scale = torch.as_tensor(out_scale, **f64).expand(self.out_features).reshape(self.num_heads, self.head_dim)
        weight_in = self.weight_in.to(torch.float64) / in_scale[None, :, None]
        bias_in = self.bias_in.to(torch.float64) - torch.einsum("i,hio->ho", in_mean, weight_in)
        self.weight_in.copy_(weight_in.to(dtype))
        self.bias_in.copy_(bias_in.to(dtype))
        self.weight_out.copy_((self.weight_out.to(torch.float64) * out_scale[:, None, :]).to(dtype))
        self.bias_out.copy_((self.bias_out.to(torch.float64) * out_scale + out_mean).to(dtype))
        return self
