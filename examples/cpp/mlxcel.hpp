// mlxcel.hpp: a small header-only C++17 RAII wrapper over the mlxcel C ABI.
// Handles are freed by destructors; errors become mlxcel::Error exceptions.
// Exceptions never cross the C boundary: the streaming callback catches them
// and rethrows after the C call returns.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mlxcel.h"

namespace mlxcel {

class Error : public std::runtime_error {
public:
    Error(mlxcel_status status, const std::string &what)
        : std::runtime_error(what + ": " + mlxcel_status_string(status) + ": " + mlxcel_last_error()), status_(status) {}
    mlxcel_status status() const noexcept { return status_; }

private:
    mlxcel_status status_;
};

inline void check(mlxcel_status status, const char *what) {
    if (status < 0) throw Error(status, what);
}

struct Generation {
    std::string text;
    mlxcel_generation_result result{};
    bool cancelled = false;
};

class Model {
public:
    // An empty path loads the default model.
    explicit Model(const std::string &path = {}) {
        mlxcel_model_params params = mlxcel_model_default_params();
        params.path = path.empty() ? nullptr : path.c_str();
        check(mlxcel_model_load(params, &handle_), "mlxcel_model_load");
    }
    ~Model() { mlxcel_model_free(handle_); }
    Model(const Model &) = delete;
    Model &operator=(const Model &) = delete;
    Model(Model &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
    Model &operator=(Model &&other) noexcept {
        if (this != &other) {
            mlxcel_model_free(handle_);
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }

    mlxcel_model *get() const noexcept { return handle_; }

    mlxcel_model_info info() const {
        mlxcel_model_info info;
        check(mlxcel_model_get_info(handle_, &info), "mlxcel_model_get_info");
        return info;
    }

    std::vector<int32_t> tokenize(const std::string &text, bool add_special = true) const {
        size_t n = 0;
        mlxcel_status status = mlxcel_tokenize(handle_, text.c_str(), add_special, nullptr, 0, &n);
        if (status != MLXCEL_ERR_BUFFER_TOO_SMALL) check(status, "mlxcel_tokenize");
        std::vector<int32_t> ids(n);
        check(mlxcel_tokenize(handle_, text.c_str(), add_special, ids.data(), ids.size(), &n), "mlxcel_tokenize");
        return ids;
    }

    std::string detokenize(const std::vector<int32_t> &ids, bool skip_special = true) const {
        return read_string([&](char *out, size_t cap, size_t *needed) {
            return mlxcel_detokenize(handle_, ids.data(), ids.size(), skip_special, out, cap, needed);
        }, "mlxcel_detokenize");
    }

    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> &messages,
                                    bool add_generation_prompt = true) const {
        std::vector<const char *> roles, contents;
        for (const auto &m : messages) {
            roles.push_back(m.first.c_str());
            contents.push_back(m.second.c_str());
        }
        return read_string([&](char *out, size_t cap, size_t *needed) {
            return mlxcel_apply_chat_template(handle_, roles.data(), contents.data(), messages.size(),
                                              add_generation_prompt, out, cap, needed);
        }, "mlxcel_apply_chat_template");
    }

    // Calls `fill(out, cap, &needed)` twice: once to size, once to fill.
    template <class F> static std::string read_string(F fill, const char *what) {
        size_t needed = 0;
        mlxcel_status status = fill(nullptr, 0, &needed);
        if (status != MLXCEL_ERR_BUFFER_TOO_SMALL) check(status, what);
        std::string s(needed + 1, '\0');
        check(fill(s.data(), s.size(), &needed), what);
        s.resize(needed);
        return s;
    }

private:
    mlxcel_model *handle_ = nullptr;
};

class Context {
public:
    using OnPiece = std::function<bool(std::string_view text, int32_t token)>;

    explicit Context(const Model &model) { check(mlxcel_context_new(model.get(), &handle_), "mlxcel_context_new"); }
    ~Context() { mlxcel_context_free(handle_); }
    Context(const Context &) = delete;
    Context &operator=(const Context &) = delete;
    Context(Context &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
    Context &operator=(Context &&other) noexcept {
        if (this != &other) {
            mlxcel_context_free(handle_);
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }

    // Thread-safe: stops the generation running on this context.
    void cancel() { check(mlxcel_cancel(handle_), "mlxcel_cancel"); }

    Generation generate(const std::string &prompt, const mlxcel_generate_params &params, OnPiece on_piece = {}) {
        return run([&](mlxcel_piece_callback cb, void *ud, mlxcel_generation_result *result) {
            return mlxcel_generate(handle_, prompt.c_str(), params, cb, ud, nullptr, 0, result);
        }, std::move(on_piece), "mlxcel_generate");
    }

    Generation chat(const std::vector<std::pair<std::string, std::string>> &messages,
                    const mlxcel_generate_params &params, OnPiece on_piece = {}) {
        std::vector<const char *> roles, contents;
        for (const auto &m : messages) {
            roles.push_back(m.first.c_str());
            contents.push_back(m.second.c_str());
        }
        return run([&](mlxcel_piece_callback cb, void *ud, mlxcel_generation_result *result) {
            return mlxcel_generate_chat(handle_, roles.data(), contents.data(), messages.size(), params, cb, ud,
                                        nullptr, 0, result);
        }, std::move(on_piece), "mlxcel_generate_chat");
    }

private:
    struct Stream {
        OnPiece on_piece;
        std::exception_ptr error;
    };

    static bool trampoline(const char *text, size_t len, int32_t token, void *user_data) {
        auto *stream = static_cast<Stream *>(user_data);
        try {
            return stream->on_piece(std::string_view(text, len), token);
        } catch (...) {
            stream->error = std::current_exception();  // rethrown once mlxcel has returned
            return false;
        }
    }

    template <class F> Generation run(F call, OnPiece on_piece, const char *what) {
        Stream stream{std::move(on_piece), nullptr};
        Generation g;
        mlxcel_status status = call(stream.on_piece ? trampoline : nullptr, &stream, &g.result);
        if (stream.error) std::rethrow_exception(stream.error);
        check(status, what);
        g.cancelled = status == MLXCEL_CANCELLED;
        g.text = Model::read_string([&](char *out, size_t cap, size_t *needed) {
            return mlxcel_context_text(handle_, out, cap, needed);
        }, "mlxcel_context_text");
        return g;
    }

    mlxcel_context *handle_ = nullptr;
};

}  // namespace mlxcel
