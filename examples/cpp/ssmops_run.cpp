// ssmops_run: load the ssmops operator library, then run an AOTInductor package
// (.pt2) or a TorchScript file on inputs from a file or the command line, and print
// the outputs and the time per run. No Python is involved.
//
//   ssmops_run --ops-library LIB.so (--package MODEL.pt2 | --torchscript MODEL.pt)
//              (--inputs INPUTS.pt | --random 2x8x64[:int64] ...)
//              [--repeat N] [--threads N] [--save-outputs OUT.pt]
//
// INPUTS.pt is a list of tensors written by Python's torch.save (ssmops export
// writes one beside the model); OUT.pt is read back in Python with torch.load.

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/serialize.h>

namespace {

struct Options {
  std::string ops_library, package, torchscript, inputs_file, save_outputs;
  std::vector<std::string> random_specs;
  int repeat = 10;
  int threads = 0;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "error: " << problem << "\n"
            << "usage: ssmops_run --ops-library LIB.so (--package MODEL.pt2 | --torchscript MODEL.pt)\n"
            << "                  (--inputs INPUTS.pt | --random SHAPE[:DTYPE] ...)\n"
            << "                  [--repeat N] [--threads N] [--save-outputs OUT.pt]\n";
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--ops-library") o.ops_library = value();
    else if (arg == "--package") o.package = value();
    else if (arg == "--torchscript") o.torchscript = value();
    else if (arg == "--inputs") o.inputs_file = value();
    else if (arg == "--random") o.random_specs.push_back(value());
    else if (arg == "--repeat") o.repeat = std::stoi(value());
    else if (arg == "--threads") o.threads = std::stoi(value());
    else if (arg == "--save-outputs") o.save_outputs = value();
    else usage("unknown argument " + arg);
  }
  if (o.ops_library.empty()) usage("--ops-library is required (python -c 'import ssmops; print(ssmops.library_path())')");
  if (o.package.empty() == o.torchscript.empty()) usage("give exactly one of --package and --torchscript");
  if (o.inputs_file.empty() == o.random_specs.empty()) usage("give --inputs or --random, not both");
  if (o.repeat < 1) usage("--repeat must be >= 1");
  return o;
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// "2x8x64" or "2x64:int64": normal floats, or integers in [0, 100) (token ids).
at::Tensor random_input(const std::string& spec) {
  auto colon = spec.find(':');
  std::string dims = spec.substr(0, colon), dtype = colon == std::string::npos ? "float32" : spec.substr(colon + 1);
  std::vector<int64_t> shape;
  std::stringstream ss(dims);
  for (std::string d; std::getline(ss, d, 'x');) shape.push_back(std::stoll(d));
  if (dtype == "float32") return torch::randn(shape);
  if (dtype == "int64") return torch::randint(0, 100, shape, torch::kLong);
  throw std::runtime_error("--random dtype must be float32 or int64, got " + dtype);
}

std::vector<at::Tensor> load_inputs(const Options& o) {
  std::vector<at::Tensor> inputs;
  if (!o.inputs_file.empty()) {
    c10::IValue value = torch::pickle_load(read_file(o.inputs_file));
    if (value.isTensor()) return {value.toTensor()};
    auto items = value.isList() ? value.toListRef().vec() : value.toTupleRef().elements().vec();
    for (const auto& item : items) inputs.push_back(item.toTensor());
    return inputs;
  }
  torch::manual_seed(0);
  for (const auto& spec : o.random_specs) inputs.push_back(random_input(spec));
  return inputs;
}

void print_tensor(const std::string& name, const at::Tensor& t) {
  std::cout << name << ": " << t.sizes() << " " << t.dtype();
  auto flat = t.detach().to(torch::kFloat).flatten();
  std::cout << "  sum " << flat.sum().item<double>() << "  first [";
  for (int64_t i = 0; i < std::min<int64_t>(4, flat.numel()); ++i) std::cout << (i ? ", " : "") << flat[i].item<float>();
  std::cout << (flat.numel() > 4 ? ", ...]" : "]") << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  // The operator library defines the ssmops schemas and CPU kernels when it loads.
  if (!dlopen(o.ops_library.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
    std::cerr << "error: cannot load the ops library " << o.ops_library << ": " << dlerror() << "\n";
    return 1;
  }
  if (o.threads > 0) at::set_num_threads(o.threads);
  try {
    std::vector<at::Tensor> inputs = load_inputs(o);
    torch::NoGradGuard no_grad;
    std::function<std::vector<at::Tensor>()> run;
    std::unique_ptr<torch::inductor::AOTIModelPackageLoader> package;
    torch::jit::Module script;
    if (!o.package.empty()) {
      package = std::make_unique<torch::inductor::AOTIModelPackageLoader>(o.package);
      run = [&] { return package->run(inputs); };
    } else {
      script = torch::jit::load(o.torchscript);
      script.eval();
      run = [&] {
        std::vector<c10::IValue> args(inputs.begin(), inputs.end());
        c10::IValue out = script.forward(args);
        if (out.isTensor()) return std::vector<at::Tensor>{out.toTensor()};
        std::vector<at::Tensor> outs;
        for (const auto& item : out.toTupleRef().elements()) outs.push_back(item.toTensor());
        return outs;
      };
    }
    std::vector<at::Tensor> outputs = run();  // warm-up, and the outputs printed
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.repeat; ++i) run();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / o.repeat;

    for (size_t i = 0; i < inputs.size(); ++i) print_tensor("input " + std::to_string(i), inputs[i]);
    for (size_t i = 0; i < outputs.size(); ++i) print_tensor("output " + std::to_string(i), outputs[i]);
    std::cout << "time per run: " << ms << " ms (mean of " << o.repeat << ", " << at::get_num_threads()
              << " threads)\n";
    if (!o.save_outputs.empty()) {
      // a tuple of tensors: torch.load(..., weights_only=True) reads it back
      std::vector<c10::IValue> items(outputs.begin(), outputs.end());
      std::vector<char> bytes = torch::pickle_save(c10::ivalue::Tuple::create(std::move(items)));
      std::ofstream(o.save_outputs, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
