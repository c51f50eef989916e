import sys, numpy as np, torch, pyro, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
from memory_flat import write_data
def st():
    d={}
    for line in open("/proc/self/status"):
        if line.split(":")[0] in ("VmRSS","RssAnon","RssFile","VmHWM"): d[line.split(":")[0]]=int(line.split()[1])//1024
    return d
path="/tmp/fitbench/m7.npy"
import os
if not os.path.exists(path): write_data(path, 10**7)
print("start", st())
pyro.settings.set(module_local_params=True)
from pyro.contrib.gp.kernels import RBF
import pyro_sparsegp as ps
from pyro_sparsegp.data_stream import MemmapDataset
from pyro_sparsegp.infer import fit
print("imports", st())
ds = MemmapDataset(path); print("ds", st())
Z = ds[torch.randint(len(ds), (128,))][0]; print("Z", st())
gp = ps.SVGP(RBF(8, lengthscale=torch.ones(8)), Z, ps.Gaussian(0.1))
fit(gp, dataset=ds, num_steps=3, batch_size=1024, progress=False); print("fit3", st())
fit(gp, dataset=ds, num_steps=30, batch_size=1024, progress=False); print("fit30", st())
