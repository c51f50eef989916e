
import sys, torch
predict = torch.export.load("powerplant_svgp.pt2").module()
X = torch.load("batch.pt")
t = __import__("time").perf_counter()
mean, var, y_mean, y_var = predict(X)
ms = 1000 * (__import__("time").perf_counter() - t)
torch.save({"mean": mean, "y_var": y_var}, "answer.pt")
print(f"served {len(X)} rows in {ms:.1f} ms; pyro imported: {'pyro' in sys.modules}, "
      f"pyro_sparsegp imported: {'pyro_sparsegp' in sys.modules}")
