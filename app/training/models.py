"""torchvision ResNets with a CIFAR-sized stem, and a tiny CNN for fast runs."""
from __future__ import annotations

from torch import nn


def _cifar_resnet(name: str, num_classes: int) -> nn.Module:
    import torchvision   # only here: a tiny-model restart need not pay for importing it

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    # ImageNet's 7x7 stride-2 stem and max-pool would shrink a 32x32 image to 8x8 before the
    # first block; CIFAR ResNets use one 3x3 stride-1 convolution and no pooling instead.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _tiny(num_classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 32), *block(32, 64), nn.MaxPool2d(2, ceil_mode=True), *block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
    )


def build(name: str, num_classes: int) -> nn.Module:
    return _tiny(num_classes) if name == "tiny" else _cifar_resnet(name, num_classes)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

