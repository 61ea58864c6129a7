"""Throughput-benchmark tasks: CIFAR-10-shaped synthetic data and the papers' CNNs.

The data set is smooth random 3x32x32 images labelled by a fixed random "teacher": one
layer of ten random 3x3 filters, ReLU and global average pooling, each output z-scored
over the data set, label = argmax. The teacher shares a CNN's translation invariance, so
the loss genuinely decreases (ResNet-20 at the defaults: eval accuracy from chance to
about 35% in four epochs) while nothing is downloaded. It is generated from a fixed
generator seed, independent of ``TaskOptions.seed``, so every worker sees the same data.

Two models:
    * ``synthetic-cnn``: ResNet-20 (about 0.27M parameters), the CIFAR-10 model of the
      AD-PSGD paper (Lian et al., 2018).
    * ``synthetic-vgg16``: VGG-16 for CIFAR-10 (about 15M parameters), the model of the
      Ripples paper (Luo et al., 2020).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional

from ripples.worker.tasks import Task, TaskOptions, classification_task

DEFAULT_LEARNING_RATE = 0.05
DEFAULT_BATCH_SIZE = 32
MOMENTUM = 0.9
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
NUM_TRAIN_SAMPLES = 4096
NUM_EVAL_SAMPLES = 512
DATA_SEED = 20_240_601
"""Fixed, independent of ``TaskOptions.seed``: every worker must see the same data."""
NOISE_UPSAMPLE_FACTOR = 2
"""Images are noise drawn at 16x16 and upsampled: smoother images make an easier teacher."""

VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "pool",
    128, 128, "pool",
    256, 256, 256, "pool",
    512, 512, 512, "pool",
    512, 512, 512, "pool",
)  # fmt: skip
"""Output channels of each 3x3 conv, and where the 2x2 max-pools go (VGG-16, config D)."""


def make_synthetic_dataset(
    num_train: int = NUM_TRAIN_SAMPLES, num_eval: int = NUM_EVAL_SAMPLES
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Generate the teacher-labelled data set, deterministically.

    Args:
        num_train: Number of training samples.
        num_eval: Number of evaluation samples.

    Returns:
        ``(train_inputs, train_targets, eval_inputs, eval_targets)`` on CPU: float32
        images of shape ``(n, 3, 32, 32)`` and int64 labels in ``[0, 10)``.
    """
    generator = torch.Generator().manual_seed(DATA_SEED)
    channels, height, width = IMAGE_SHAPE
    noise = torch.randn(
        num_train + num_eval,
        channels,
        height // NOISE_UPSAMPLE_FACTOR,
        width // NOISE_UPSAMPLE_FACTOR,
        generator=generator,
    )
    inputs = functional.interpolate(noise, size=(height, width), mode="bilinear")
    inputs = inputs / inputs.std()
    teacher_filters = torch.randn(NUM_CLASSES, channels, 3, 3, generator=generator)
    logits = functional.relu(functional.conv2d(inputs, teacher_filters, padding=1))
    logits = logits.mean(dim=(2, 3))
    # Pooled activations differ little between images; z-scoring makes every class occur.
    logits = (logits - logits.mean(dim=0)) / logits.std(dim=0)
    targets = logits.argmax(dim=1)
    return inputs[:num_train], targets[:num_train], inputs[num_train:], targets[num_train:]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            # A 1x1 projection where the shape changes (option B); adds about 3k parameters.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = functional.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return functional.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    """The CIFAR ResNet of depth ``6n + 2``: three stages of ``n`` blocks, 16/32/64 wide."""

    def __init__(self, blocks_per_stage: int = 3, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(IMAGE_SHAPE[0], 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        in_channels = 16
        for stage, out_channels in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.stages(self.stem(x))
        return self.head(functional.adaptive_avg_pool2d(out, 1).flatten(1))


def build_resnet20() -> nn.Module:
    """ResNet-20 for 32x32 inputs (about 0.27M parameters), on CPU."""
    return ResNetCifar(blocks_per_stage=3)


def build_vgg16() -> nn.Module:
    """VGG-16 with BatchNorm for 32x32 inputs and a single linear classifier (~15M params)."""
    layers: list[nn.Module] = []
    in_channels = IMAGE_SHAPE[0]
    for item in VGG16_LAYOUT:
        if item == "pool":
            layers.append(nn.MaxPool2d(2))
        else:
            assert isinstance(item, int)
            layers += [
                nn.Conv2d(in_channels, item, 3, padding=1, bias=False),
                nn.BatchNorm2d(item),
                nn.ReLU(),
            ]
            in_channels = item
    # Five pools take 32x32 down to 1x1, so the classifier sees 512 features.
    layers += [nn.Flatten(), nn.Linear(in_channels, NUM_CLASSES)]
    return nn.Sequential(*layers)


def _build(options: TaskOptions, build_model: Callable[[], nn.Module]) -> Task:
    """Assemble a synthetic task around the model ``build_model()`` returns. The labels
    come from the teacher's outputs z-scored over the whole set, so the set is generated
    whole where a dataset is asked for; a worker keeps only the training part."""
    return classification_task(
        options, load=make_synthetic_dataset, build_model=build_model,
        learning_rate=DEFAULT_LEARNING_RATE, momentum=MOMENTUM,
        batch_size=DEFAULT_BATCH_SIZE, num_classes=NUM_CLASSES)


def synthetic_cnn(options: TaskOptions) -> Task:
    """ResNet-20 on the synthetic data; defaults lr 0.05, batch size 32.

    Args:
        options: Seed for model initialisation, device, and optional overrides.

    Returns:
        The task (4096 training and 512 evaluation samples).
    """
    return _build(options, build_resnet20)


def synthetic_vgg16(options: TaskOptions) -> Task:
    """VGG-16 on the synthetic data; defaults lr 0.05, batch size 32.

    Args:
        options: Seed for model initialisation, device, and optional overrides.

    Returns:
        The task (4096 training and 512 evaluation samples).
    """
    return _build(options, build_vgg16)
