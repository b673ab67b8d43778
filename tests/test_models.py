import pytest
import torch
from torch import nn

from ddpkit.training.models import MODELS, VGG11, VGG11_CONFIG, ResNet18, ResNet34, TemplateNet, build_model

SHAPES = [(1, 28, 10), (3, 32, 100)]  # (in_channels, image_size, num_classes)


@pytest.mark.parametrize("in_channels,image_size,num_classes", SHAPES)
@pytest.mark.parametrize("name", MODELS)
def test_forward_and_backward(name, in_channels, image_size, num_classes):
    torch.manual_seed(0)
    model = build_model(name, in_channels, num_classes, image_size)
    x = torch.randn(2, in_channels, image_size, image_size)
    logits = model(x)
    assert logits.shape == (2, num_classes) and logits.dtype == torch.float32
    nn.functional.cross_entropy(logits, torch.tensor([0, num_classes - 1])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    assert model(x[:1]).shape == (1, num_classes)


def test_model_names():
    assert MODELS == ("net", "vgg11", "resnet18", "resnet34")
    with pytest.raises(ValueError, match="unknown model 'resnet50'"):
        build_model("resnet50", 3, 10, 32)
    with pytest.raises(ValueError, match="in_channels and num_classes must be >= 1"):
        build_model("net", 0, 10, 32)


@pytest.mark.parametrize("name", MODELS)
def test_only_torch_batch_norm(name):
    model = build_model(name, 3, 10, 32)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    assert norms and all(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in norms)


def test_template_net_architecture():
    net = TemplateNet(in_channels=3, num_classes=100, image_size=32)
    assert net.fc1.in_features == 6272
    assert TemplateNet(1, 10, 28).fc1.in_features == 4608
    for conv, in_channels in ((net.conv1, 3), (net.conv2, 32)):
        assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) == (
            in_channels,
            32,
            (3, 3),
            (1, 1),
            (0, 0),
        )
    assert (net.dropout1.p, net.dropout2.p) == (0.25, 0.5)
    assert (net.fc1.out_features, net.fc2.in_features, net.fc2.out_features) == (128, 128, 100)
    assert net.bn1.num_features == 128 and not net.bn1.affine
    with pytest.raises(ValueError, match="image_size >= 6"):
        TemplateNet(1, 10, 4)


def test_template_net_forward_order():
    # With dropout off, the forward pass is conv1, relu, conv2, relu, max-pool, flatten, fc1, bn1, relu, fc2.
    torch.manual_seed(0)
    net = TemplateNet(1, 10, 28).eval()
    net.bn1.running_mean.uniform_(-1, 1)
    net.bn1.running_var.uniform_(0.5, 2)
    x = torch.randn(3, 1, 28, 28)
    f = nn.functional
    h = f.max_pool2d(f.relu(net.conv2(f.relu(net.conv1(x)))), 2).flatten(1)
    h = f.relu((net.fc1(h) - net.bn1.running_mean) / torch.sqrt(net.bn1.running_var + net.bn1.eps))
    torch.testing.assert_close(net(x), net.fc2(h))


def test_vgg11_layers():
    model = VGG11(in_channels=1, num_classes=10)
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [c for c in VGG11_CONFIG if c != "M"]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs)
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.features) == 5
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.features) == 8
    assert (model.classifier.in_features, model.classifier.out_features) == (512, 10)


def test_resnet_sizes():
    def parameters(model):
        return sum(p.numel() for p in model.parameters())

    # The CIFAR ResNet-18's well-known size: 11,173,962 parameters for 10 classes.
    assert parameters(ResNet18(3, 10)) == 11_173_962
    assert parameters(ResNet34(3, 10)) == 21_282_122
    assert [len(stage) for stage in ResNet18().stages] == [2, 2, 2, 2]
    assert [len(stage) for stage in ResNet34().stages] == [3, 4, 6, 3]
    stem = ResNet18(in_channels=1).stem[0]
    assert (stem.in_channels, stem.kernel_size, stem.stride) == (1, (3, 3), (1, 1))
    assert not any(isinstance(m, nn.MaxPool2d) for m in ResNet18().modules())
