// generate.cpp: the C++ RAII wrapper (mlxcel.hpp) in use.
//
//   cargo build --release -p mlxcel-capi
//   c++ -std=c++17 -I include -I examples/cpp examples/cpp/generate.cpp -L target/release -lmlxcel
//       -Wl,-rpath,$PWD/target/release -o generate_cpp
//   ./generate_cpp [--model DIR] [--max-tokens N] "The capital of France is"
//
// Streams the continuation to stdout, then checks that the streamed pieces,
// the returned text and a tokenize/detokenize round trip agree.
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "mlxcel.hpp"

int main(int argc, char **argv) {
    std::string model_path, prompt;
    int max_tokens = 32;
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
            model_path = argv[++i];
        } else if (std::strcmp(argv[i], "--max-tokens") == 0 && i + 1 < argc) {
            max_tokens = std::atoi(argv[++i]);
        } else {
            prompt = argv[i];
        }
    }
    if (prompt.empty()) {
        std::cerr << "usage: " << argv[0] << " [--model DIR] [--max-tokens N] PROMPT\n";
        return 2;
    }
    try {
        mlxcel::Model model(model_path);
        mlxcel_model_info info = model.info();
        std::cerr << "mlxcel " << mlxcel_version() << ": " << info.architecture << ", " << info.num_layers
                  << " layers, vocab " << info.vocab_size << "\n";

        mlxcel::Context ctx(model);
        mlxcel_generate_params params = mlxcel_generate_default_params();
        params.max_tokens = max_tokens;
        std::string streamed;
        mlxcel::Generation g = ctx.generate(prompt, params, [&](std::string_view piece, int32_t) {
            std::cout << piece << std::flush;
            streamed += piece;
            return true;
        });
        std::cout << "\n";
        if (streamed != g.text) {
            std::cerr << "streamed text differs from the returned text\n";
            return 1;
        }
        std::vector<int32_t> ids = model.tokenize(g.text, false);
        if (model.detokenize(ids) != g.text) {
            std::cerr << "tokenize/detokenize round trip failed\n";
            return 1;
        }
        std::cerr << "generated " << g.result.generated_tokens << " tokens (" << ids.size()
                  << " when re-tokenized)\n";

        // Errors come back as exceptions carrying the status.
        params.temperature = -1.0f;
        try {
            ctx.generate(prompt, params);
            std::cerr << "temperature -1 was accepted\n";
            return 1;
        } catch (const mlxcel::Error &e) {
            if (e.status() != MLXCEL_ERR_INVALID_ARGUMENT) throw;
            std::cerr << "as expected: " << e.what() << "\n";
        }
    } catch (const std::exception &e) {
        std::cerr << "error: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
