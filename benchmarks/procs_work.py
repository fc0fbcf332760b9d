"""The per-item Python work of benchmarks/bench_process_stage.py, in a module of its own so that
worker processes (splitflow's processes=N and DataLoader's num_workers=N alike) import it by
name under the spawn start method."""
import numpy as np
import torch
import torchvision.transforms as T
from PIL import Image

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def pil_transform(seed):
    """What users write: PIL in, RandomResizedCrop(224), flip, ToTensor, Normalize."""
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(MEAN, STD)])


class FromPath:
    """index -> PIL decode -> torchvision transform -> float32 (3, 224, 224) tensor."""

    def __init__(self, paths):
        self.paths = paths
        self.t = None

    def __call__(self, i):
        if self.t is None:
            self.t = pil_transform(0)
        with Image.open(self.paths[i]) as im:
            return self.t(im.convert("RGB"))


class FromPathPurePython(FromPath):
    """FromPath plus pure-Python work that holds the GIL (a hand-written augmentation: a loop
    over 40,000 values, about 3 ms here), where a thread stage runs one item at a time."""

    def __call__(self, i):
        x = super().__call__(i)
        acc = 0
        for k in range(40_000):
            acc = (acc * 31 + k) & 0xFFFF
        x[0, 0, 0] += acc * 0.0
        return x


class OnDecoded:
    """A decoded (H, W, 3) uint8 image (from splitflow's C++ decode) -> the same torchvision
    transform on a tensor: RandomResizedCrop(224, antialias), flip, to float, Normalize."""

    def __init__(self):
        self.crop = T.RandomResizedCrop(224, antialias=True)
        self.flip = T.RandomHorizontalFlip()
        self.norm = T.Normalize(MEAN, STD)

    def __call__(self, image):
        x = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)
        x = self.flip(self.crop(x))
        return self.norm(x.float().div_(255.0))


class OnDecodedPil:
    """The same, the decoded array wrapped as a PIL image (no decode): PIL's crop + resize."""

    def __init__(self):
        self.t = None

    def __call__(self, image):
        if self.t is None:
            self.t = pil_transform(0)
        return self.t(Image.fromarray(np.asarray(image)))


class Files(torch.utils.data.Dataset):
    """The DataLoader baseline: the same FromPath work in __getitem__."""

    def __init__(self, paths):
        self.work = FromPath(paths)
        self.n = len(paths)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.work(i)
