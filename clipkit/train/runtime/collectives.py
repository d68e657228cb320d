"""Feature gathering across processes, used only by :mod:`clipkit.train.runtime`.

Two ways to assemble the global batch from each process's share (METHODS §11):

- :func:`gather_with_grad`: the backward sums, over processes, the gradient every process computed
  for each block and hands each process the sum for its own block (the adjoint of all-gather).
  A loss computed by every process on the whole batch therefore gives each process
  ``world_size ×`` the full-batch gradient of its features, which DDP's averaging cancels.
- :func:`gather_without_grad`: other processes' blocks are constants; this process's own block is
  its local tensor itself, so the gradient still reaches its own encoder (CLOOB's and SLIP's code).

Every process must contribute a block of the same shape (the data plan guarantees equal batch
sizes); a mismatch raises instead of hanging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 8  # blocks are [n, ...] with at most this many dimensions (point sets have 3)


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_blocks(tensor: torch.Tensor) -> list[torch.Tensor]:
    """[n, ...] on every process -> W blocks [n, ...] (rank order); bools travel as uint8 (gloo)."""
    _, size = world()
    _check_same_shape(tensor, size)
    sendable = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    blocks = [torch.empty_like(sendable) for _ in range(size)]
    dist.all_gather(blocks, sendable.contiguous())
    return [block.to(torch.bool) for block in blocks] if tensor.dtype == torch.bool else blocks


def _check_same_shape(tensor: torch.Tensor, size: int) -> None:
    """Raise (instead of hanging or mixing rows) when processes hold differently shaped blocks.
    One small tensor all-gather (no pickling), so it stays cheap on NCCL."""
    padded = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim())
    shape = torch.tensor(padded, dtype=torch.long, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape)
    if not all(torch.equal(other, shape) for other in shapes):
        found = [tuple(d for d in other.tolist() if d >= 0) for other in shapes]
        raise RuntimeError(f"processes hold differently shaped blocks {found}; the gather needs equal shapes")


class _GatherWithGrad(torch.autograd.Function):
    """[n, ...] -> [W·n, ...]; backward: all-reduce (sum) the gradient, keep this rank's block."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.rows = world()[0], tensor.shape[0]
        return torch.cat(_all_gather_blocks(tensor))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [W·n, ...] in rank order; gradients flow back to every block's owner."""
    if world()[1] == 1:
        return tensor
    if not tensor.requires_grad:
        return torch.cat(_all_gather_blocks(tensor))
    return _GatherWithGrad.apply(tensor)


def gather_without_grad(tensor: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [W·n, ...]; other blocks are detached, this process's block is ``tensor`` itself."""
    rank, size = world()
    if size == 1:
        return tensor
    with torch.no_grad():
        blocks = _all_gather_blocks(tensor.detach())
    blocks[rank] = tensor
    return torch.cat(blocks)


def gather_objects(values: list) -> list:
    """Per-sample Python values (meta-data lists) of every process, concatenated in rank order."""
    if world()[1] == 1:
        return list(values)
    gathered: list = [None] * world()[1]
    dist.all_gather_object(gathered, list(values))
    return [value for block in gathered for value in block]


def all_true(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` holds on every process (one small all-reduce; every process must call)."""
    if world()[1] == 1:
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0.5)
